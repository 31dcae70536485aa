"""A JSON schema with a nested object, enums and an array whose replies are short
(~20 tokens: one-letter keys and values keep 100 replies cheap on a CPU), shared by the
offline and the server tests: 100 replies out of 100 must validate."""

SCHEMA = {
    "type": "object",
    "properties": {
        "k": {"enum": ["cat", "dog"]},
        "o": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
        "t": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["k", "o", "t"],
}
# Enough for the longest reply the schema allows (compact separators, one token a character).
MAX_TOKENS = 50
PROMPT = "A pet as JSON:"
NUM_REPLIES = 100
