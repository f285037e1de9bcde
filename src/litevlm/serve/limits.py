"""The server's limits: what clients may ask of it, checked once when a server is built."""

from __future__ import annotations

from dataclasses import dataclass

from litevlm.cameras import CAMERAS


@dataclass(frozen=True)
class Limits:
    """What clients may ask of the server. `max_queue` counts requests waiting for the model besides
    the one it is answering; `timeout_s` runs from arrival to the finished answer. A client gets
    `header_timeout_s` to send a request's headers and `body_timeout_s` to send its body (408), and
    at most `max_connections` connections are open at once (more are closed on accept). Up to `max_batch` admitted
    requests decode together, each joining the running batch at its next step (`litevlm.batch`)."""

    max_queue: int = 16
    timeout_s: float = 60.0
    max_body_bytes: int = 32 * 2**20
    max_image_pixels: int = 3200 * 1800  # four nuScenes frames' worth
    max_images: int = len(CAMERAS)
    max_prompt_chars: int = 4000
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 256
    max_batch: int = 8  # answers decoded together (in-flight batching); 1: one at a time

    def __post_init__(self):
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be >= 1, got {self.max_image_pixels}")
        if not 1 <= self.max_images <= len(CAMERAS):
            raise ValueError(f"max_images must be in 1..{len(CAMERAS)} (one image per camera), got {self.max_images}")
        if self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
