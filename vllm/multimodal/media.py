"""Images from where requests bring them: PIL images, data: URIs, http(s) URLs, files.

    "data:image/png;base64,...."  -> base64 decode (size-capped) -> Pillow
    "http(s)://..."               -> httpx GET, VLLM_IMAGE_FETCH_TIMEOUT s in all (a read
                                     waits at most that long, so a stalled download
                                     ends within twice it), VLLM_MAX_IMAGE_BYTES
    "file:///abs/path"            -> only under --allowed-local-media-path (resolved path)
    PIL.Image.Image               -> as is

Every failure is a `VLLMValidationError` whose `parameter` names the part it came
from ("messages.0.content.1.image_url"), so the server answers 400 and goes on.
An image is decoded whole (`Image.load()`) here, on the frontend: a truncated
file fails now, not in the engine core.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from vllm import envs
from vllm.exceptions import VLLMValidationError

if TYPE_CHECKING:
    from PIL import Image


def decode_image(data: bytes, where: str) -> Image.Image:
    """Encoded image bytes -> an RGB PIL image, fully decoded (transparency onto white:
    `to_rgb`).

    Raises:
        VLLMValidationError (parameter `where`): not an image Pillow reads, a
            truncated one, more pixels than Pillow's decompression-bomb limit,
            or more bytes than VLLM_MAX_IMAGE_BYTES.
    """
    from PIL import Image, UnidentifiedImageError

    _check_size(len(data), where)
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if Image.MAX_IMAGE_PIXELS and width * height > Image.MAX_IMAGE_PIXELS:
            raise VLLMValidationError(
                f"{where}: the image is too large ({width}x{height} pixels; at most "
                f"{Image.MAX_IMAGE_PIXELS} pixels)", parameter=where)
        image.load()  # decodes every byte: a truncated file raises here
        return to_rgb(image)
    except VLLMValidationError:
        raise
    except UnidentifiedImageError:
        raise VLLMValidationError(f"{where}: the data is not an image Pillow can read",
                                  parameter=where) from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise VLLMValidationError(f"{where}: the image cannot be decoded ({e})",
                                  parameter=where) from None


def to_rgb(image: Image.Image) -> Image.Image:
    """An RGB copy of `image` (itself when RGB): transparency composited onto white, as
    transformers' image processors and vLLM convert it (`convert("RGB")` alone would keep
    the colours under transparent pixels). transformers' `convert_to_rgb`."""
    from PIL import Image
    from transformers.image_transforms import convert_to_rgb

    if image.mode == "RGB":
        return image
    return Image.fromarray(convert_to_rgb(image, return_numpy=True))


def _check_size(num_bytes: int, where: str) -> None:
    cap = int(envs.VLLM_MAX_IMAGE_BYTES)
    if num_bytes > cap:
        raise VLLMValidationError(
            f"{where}: the image is too large ({num_bytes} bytes; at most {cap}, "
            "VLLM_MAX_IMAGE_BYTES)", parameter=where)


class MediaConnector:
    """Loads images from URLs of the three schemes (vLLM's class of that name).

    Args:
        allowed_local_media_path: the directory file:// URLs may read from
            (resolved; symlinks out of it are refused); None refuses file://.
    """

    def __init__(self, allowed_local_media_path: str | None = None) -> None:
        self.allowed_local_media_path = (
            Path(allowed_local_media_path).resolve() if allowed_local_media_path else None)

    def load_image(self, url: str, where: str) -> Image.Image:
        """The image at `url`; errors as `decode_image`, plus a bad URL, a refused
        scheme or path, a failed or slow download (VLLMValidationError naming `where`)."""
        if not isinstance(url, str):
            raise VLLMValidationError(f"{where} must be a string URL", parameter=where)
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return decode_image(self._data_url_bytes(url, where), where)
        if scheme in ("http", "https"):
            return decode_image(self._fetch(url, where), where)
        if scheme == "file":
            return decode_image(self._read_file(url, where), where)
        raise VLLMValidationError(
            f"{where}: unsupported image URL scheme {scheme!r}; use data:, http(s): or "
            "file: (under --allowed-local-media-path)", parameter=where)

    @staticmethod
    def _data_url_bytes(url: str, where: str) -> bytes:
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise VLLMValidationError(f"{where}: a data: URL must be base64 "
                                      "('data:image/png;base64,...')", parameter=where)
        _check_size(len(payload) * 3 // 4, where)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise VLLMValidationError(f"{where}: the data: URL is not valid base64",
                                      parameter=where) from None

    @staticmethod
    def _fetch(url: str, where: str) -> bytes:
        import httpx

        timeout = float(envs.VLLM_IMAGE_FETCH_TIMEOUT)
        # For the whole download, as vLLM's: a server that sends a byte now and then
        # (each read within the timeout) must not hold a render thread for longer.
        deadline = time.monotonic() + timeout
        try:
            with httpx.Client(timeout=timeout, follow_redirects=True) as client, \
                    client.stream("GET", url) as response:
                if response.status_code >= 400:
                    raise VLLMValidationError(
                        f"{where}: fetching the image failed: HTTP {response.status_code}",
                        parameter=where)
                chunks, size = [], 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    _check_size(size, where)
                    chunks.append(chunk)
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("the whole download took too long")
                return b"".join(chunks)
        except httpx.TimeoutException:
            raise VLLMValidationError(f"{where}: fetching the image timed out after "
                                      f"{timeout:g} s", parameter=where) from None
        except httpx.HTTPError as e:
            raise VLLMValidationError(f"{where}: fetching the image failed: {e}",
                                      parameter=where) from None

    def _read_file(self, url: str, where: str) -> bytes:
        root = self.allowed_local_media_path
        if root is None:
            raise VLLMValidationError(
                f"{where}: file: URLs need --allowed-local-media-path DIR (offline: "
                "LLM(..., allowed_local_media_path=DIR))",
                parameter=where)
        path = Path(unquote(urlparse(url).path)).resolve()
        if not path.is_relative_to(root):
            raise VLLMValidationError(f"{where}: {path} is outside --allowed-local-media-path "
                                      f"({root})", parameter=where)
        try:
            _check_size(os.path.getsize(path), where)
            return path.read_bytes()
        except OSError as e:
            raise VLLMValidationError(f"{where}: cannot read {path}: {e.strerror}",
                                      parameter=where) from None
