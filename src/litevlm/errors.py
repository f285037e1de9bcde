"""The one exception type for problems a user can cause and fix."""


class LiteVLMError(ValueError):
    """Bad input, a missing or mismatched checkpoint, an unknown camera: the message says what to do."""


class CameraError(LiteVLMError):
    """A question needs a camera view whose image was not given ("missing_cameras") or cannot be read
    ("invalid_image"): `code` says which, `cameras` names them."""

    def __init__(self, message: str, code: str, cameras: list[str]):
        super().__init__(message)
        self.code, self.cameras = code, list(cameras)
