"""SamplingParams: defaults, validation messages, greedy normalisation, clone, pickling."""

import pickle

import pytest

from vllm.sampling_params import (
    MAX_LOGPROBS,
    RequestOutputKind,
    SamplingParams,
    SamplingType,
    validate_prompt_length,
    validate_request_lengths,
    validate_token_ids,
)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.prompt_logprobs) == (
        16, 0, None, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and not p.ignore_eos
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.include_stop_str_in_output
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.sampling_type is SamplingType.RANDOM
    assert MAX_LOGPROBS == 20


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, "n must be an int >= 1, got 0"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -2.1}, "frequency_penalty must be in [-2, 2], got -2.1"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"temperature": -0.1}, "temperature must be >= 0, got -0.1"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k must be 0 or -1 (disabled) or >= 1, got -2"),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1"),
        ({"seed": 1.5}, "seed must be None or an int in [-9223372036854775808, "
                        "18446744073709551615], got 1.5"),
        ({"seed": 2**64}, "seed must be None or an int in"),
        ({"max_tokens": 0}, "max_tokens must be None or an int >= 1, got 0"),
        ({"min_tokens": -1}, "min_tokens must be an int >= 0, got -1"),
        ({"logprobs": -2}, "logprobs must be None, -1 (the whole vocabulary) or an int >= 0, "
                           "got -2"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs must be None, -1 (the whole vocabulary) "
                                   "or an int >= 0, got 1.5"),
        ({"stop": ["ok", ""]}, "stop must be non-empty strings, got ''"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be token ids >= 0, got -1"),
        ({"logit_bias": {5: 101.0}}, "logit_bias must be valued in [-100, 100], got 101.0"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias must be keyed by token ids >= 0, got '5'"),
        ({"output_kind": "delta"}, "output_kind must be a RequestOutputKind, got 'delta'"),
    ],
)
def test_invalid_values_name_field_and_range(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


NON_FINITE = [float("inf"), float("-inf"), float("nan"), 10**400]


@pytest.mark.parametrize("value", NON_FINITE, ids=["inf", "-inf", "nan", "huge-int"])
@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "presence_penalty",
                                  "frequency_penalty", "repetition_penalty"])
def test_non_finite_floats_rejected_naming_the_field(name, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{name: value})
    assert str(e.value).startswith(f"{name} must be a finite number, got ")


def test_min_tokens_above_max_tokens_names_both():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=50).min_tokens == 50


def test_boundaries_accepted():
    """The inclusive ends of every range are accepted and kept as given."""
    bounds = dict(presence_penalty=-2, frequency_penalty=2, top_p=1.0, min_p=1.0, top_k=1,
                  logprobs=0, prompt_logprobs=MAX_LOGPROBS, max_tokens=1, seed=-(2**63),
                  temperature=0.5)
    params = SamplingParams(**bounds)
    assert {name: getattr(params, name) for name in bounds} == bounds
    # One step past each end is refused, so the ends above really are the ends.
    for name, outside in [("presence_penalty", -2.01), ("frequency_penalty", 2.01),
                          ("top_p", 1.01), ("min_p", 1.01), ("top_k", -2), ("logprobs", -2),
                          ("prompt_logprobs", -2), ("max_tokens", 0)]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{**bounds, name: outside})


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0


def test_greedy_forces_truncation_off():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2, seed=7)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert p.sampling_type is SamplingType.GREEDY  # a seed does not make greedy random


def test_tiny_temperature_is_raised_to_avoid_overflow():
    assert SamplingParams(temperature=1e-3).temperature == 1e-2
    assert SamplingParams(temperature=1e-6).sampling_type is SamplingType.GREEDY


def test_sampling_type_seeded():
    assert SamplingParams(temperature=0.7, seed=1).sampling_type is SamplingType.RANDOM_SEED


def test_stop_normalised_and_buffer_length():
    p = SamplingParams(stop="END")
    assert p.stop == ["END"] and p.output_text_buffer_length == 2
    assert SamplingParams(stop=["a", "abcd"]).output_text_buffer_length == 3
    assert SamplingParams(stop=["abcd"], include_stop_str_in_output=True
                          ).output_text_buffer_length == 0


def test_all_stop_token_ids_and_generation_config():
    p = SamplingParams(stop_token_ids=[5])
    assert p.all_stop_token_ids == {5}
    p.update_from_generation_config({"eos_token_id": [2, 9]}, model_eos_token_id=2)
    assert p.all_stop_token_ids == {2, 5, 9}
    assert sorted(p.stop_token_ids) == [5, 9]  # the tokenizer's EOS is checked separately
    q = SamplingParams(ignore_eos=True)
    q.update_from_generation_config({"eos_token_id": 9}, model_eos_token_id=2)
    assert q.all_stop_token_ids == {2, 9} and q.stop_token_ids == []


def test_clone_is_independent_and_pickle_roundtrips():
    p = SamplingParams(stop=["x"], stop_token_ids=[3], logit_bias={1: 2.0}, seed=4)
    c = p.clone()
    assert c == p
    c.stop.append("y")
    c.stop_token_ids.append(4)
    c.all_stop_token_ids.add(8)
    c.logit_bias[2] = 1.0
    assert p.stop == ["x"] and p.stop_token_ids == [3] and p.all_stop_token_ids == {3}
    assert p.logit_bias == {1: 2.0}
    q = pickle.loads(pickle.dumps(p))
    assert q == p and q.all_stop_token_ids == {3} and q.output_kind is RequestOutputKind.CUMULATIVE


def test_from_optional_uses_defaults_for_none():
    p = SamplingParams.from_optional(temperature=None, top_p=0.5, n=None)
    assert p.temperature == 1.0 and p.top_p == 0.5 and p.n == 1 and p.max_tokens == 16


def test_from_optional_max_tokens_none_means_no_limit():
    """vLLM: `from_optional(max_tokens=None)` is "up to max_model_len", not the default 16."""
    assert SamplingParams.from_optional(max_tokens=None).max_tokens is None
    assert SamplingParams.from_optional(seed=None, logprobs=None).seed is None


@pytest.mark.parametrize(("kwargs", "parameter"), [
    ({"best_of": 2}, "best_of"),
    ({"best_of": 0}, "best_of"),
    ({"logits_processors": [lambda ids, logits: logits]}, "logits_processors"),
])
def test_unsupported_vllm_fields_raise_value_error(kwargs, parameter):
    """vLLM's SamplingParams takes these keywords and refuses unsupported values with a
    ValueError naming the field (a TypeError would say the keyword does not exist)."""
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError) as e:
        SamplingParams(**kwargs)
    assert e.value.parameter == parameter and parameter in str(e.value)
    assert SamplingParams(best_of=1, logits_processors=[]).best_of == 1


def test_verify_vocab_rejects_out_of_vocab_bias():
    SamplingParams(logit_bias={99: 1.0}).verify_vocab(100)
    with pytest.raises(ValueError, match=r"\[100\].*vocab_size 100"):
        SamplingParams(logit_bias={100: 1.0}).verify_vocab(100)


def test_validate_request_lengths_messages_carry_numbers():
    assert validate_prompt_length is validate_request_lengths
    assert validate_request_lengths(10, 5, 20) == 5
    assert validate_request_lengths(10, None, 20) == 10
    with pytest.raises(ValueError) as e:
        validate_request_lengths(15, 8, 20)
    assert "prompt has 15 tokens, plus max_tokens 8 exceeds max_model_len 20" in str(e.value)
    # Offline semantics: generation stops at max_model_len instead.
    assert validate_request_lengths(15, 8, 20, require_room_for_max_tokens=False) == 8
    with pytest.raises(ValueError, match="prompt has 20 tokens.*max_model_len 20"):
        validate_request_lengths(20, 1, 20, require_room_for_max_tokens=False)
    with pytest.raises(ValueError, match="empty"):
        validate_request_lengths(0, 1, 20)


def test_validate_token_ids():
    validate_token_ids([0, 5, 9], 10)
    with pytest.raises(ValueError, match=r"prompt token id 10 at position 1 .*\[0, 10\)"):
        validate_token_ids([3, 10], 10)
    with pytest.raises(ValueError, match="token id -1 at position 0"):
        validate_token_ids([-1], 10)


@pytest.mark.parametrize(("kwargs", "parameter"), [
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"stop": [""]}, "stop"),
])
def test_errors_carry_the_offending_parameter(kwargs, parameter):
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError) as e:
        SamplingParams(**kwargs)
    assert e.value.parameter == parameter


def test_length_errors_name_prompt_or_max_tokens():
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError) as e:
        validate_request_lengths(10, None, 10)
    assert e.value.parameter == "prompt"
    with pytest.raises(VLLMValidationError) as e:
        validate_request_lengths(4, 7, 10)
    assert e.value.parameter == "max_tokens"
