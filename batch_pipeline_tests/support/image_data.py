"""Images for the image tests: a solid-colour picture in any format PIL writes, and its data: URL."""

from __future__ import annotations

import base64
import io
from typing import Any


def png(color: Any = "red", size: tuple[int, int] = (40, 30), mode: str = "RGB", fmt: str = "PNG") -> bytes:
    """A `size` picture of one `color`, encoded as `fmt` (PNG by default)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()
