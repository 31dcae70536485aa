"""The model names this server answers to (`--served-model-name`) and `GET /v1/models`."""

from __future__ import annotations

import time

from vllm.entrypoints.openai.errors import APIError
from vllm.entrypoints.openai.protocol import ModelCard, ModelList


class ServedModels:
    """Names a request's `model` may use; the first is the default and the metrics label.

    Args:
        names: served model names (at least one).
        root: the model path the names stand for.
        max_model_len: the engine's context length, tokens.

    Raises:
        ValueError: no names.
    """

    def __init__(self, names: list[str], root: str, max_model_len: int) -> None:
        if not names:
            raise ValueError("served model names must not be empty")
        self.names = list(names)
        self.root = root
        self.max_model_len = max_model_len
        self.created = int(time.time())

    @property
    def default_name(self) -> str:
        return self.names[0]

    def resolve(self, requested: str | None) -> str:
        """The name to report for a request's `model` (None = the default).

        Raises:
            APIError(404): a name this server does not serve.
        """
        if requested is None or requested == "":
            return self.default_name
        if requested in self.names:
            return requested
        raise APIError(404, f"The model `{requested}` does not exist.", "model")

    def model_list(self) -> ModelList:
        return ModelList(data=[
            ModelCard(id=name, created=self.created, root=self.root,
                      max_model_len=self.max_model_len)
            for name in self.names
        ])
