"""Images in: decoding and fetching (media.py), the checkpoint's processor and placeholder
expansion (processing.py), and what a request carries to the engine core (inputs.py)."""
