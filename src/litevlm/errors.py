"""The one exception type for problems a user can cause and fix."""


class LiteVLMError(ValueError):
    """Bad input, a missing or mismatched checkpoint, an unknown camera: the message says what to do."""
