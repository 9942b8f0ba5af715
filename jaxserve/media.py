"""Images named in chat messages: ``data:`` URLs, local files (only under an allowed directory), PIL images.

No network fetches: an http(s) URL is refused, saying so. Every failure is a ``MediaError`` (a ValueError)
whose message says what was wrong and what would work, so the server turns it into a 400.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from typing import Any, Optional
from urllib.parse import unquote, urlparse

MAX_IMAGE_BYTES = 20 << 20  # an encoded image larger than this is refused before decoding
MAX_IMAGE_PIXELS = 64 << 20  # decoded width x height (PIL's own bomb check warns far later)
_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class MediaError(ValueError):
    """An image that cannot be used, with the reason."""


def load_image(url: str, allowed_local_media_path: Optional[str] = None):
    """A PIL image (RGB) from a ``data:image/...;base64,`` URL, a ``file://`` URL or a plain path."""
    if not isinstance(url, str) or not url:
        raise MediaError("image_url.url is empty: give a data: URL (base64 PNG/JPEG) or an allowed local file")
    if url.startswith("data:"):
        return decode_image(_data_url_bytes(url))
    scheme = urlparse(url).scheme.lower()
    if scheme in ("http", "https"):
        raise MediaError(
            f"image URL {url[:80]!r}: network fetches are off in jaxserve; send the image inline as a data: URL "
            "(data:image/png;base64,...) or as a file under --allowed-local-media-path"
        )
    if scheme not in ("", "file"):
        raise MediaError(f"image URL scheme {scheme!r} is not supported: use a data: URL or a local file")
    path = unquote(urlparse(url).path) if scheme == "file" else url
    return decode_image(_read_local(path, allowed_local_media_path))


def image_from_part(part: dict, allowed_local_media_path: Optional[str] = None):
    """The image of one chat content part: ``image_url`` ({"url": ...} or a string) or ``image_pil``."""
    kind = part.get("type")
    if kind == "image_pil" or "image_pil" in part:
        image = part.get("image_pil")
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise MediaError(f"image_pil must be a PIL.Image.Image, got {type(image).__name__}")
        return _check(image)
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    return load_image(url, allowed_local_media_path)


def split_image_parts(
    conversation: list[dict[str, Any]], allowed_local_media_path: Optional[str] = None
) -> tuple[list[dict[str, Any]], list[Any]]:
    """Messages with image parts -> (messages whose image parts are ``{"type": "image"}``, as chat templates
    of vision-language models expect, and the images in order)."""
    images: list[Any] = []
    out = []
    for message in conversation:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and (part.get("type") in ("image_url", "image_pil", "image")):
                    if part.get("type") == "image" and "image" in part:
                        images.append(_check(part["image"]))
                    else:
                        images.append(image_from_part(part, allowed_local_media_path))
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out, images


def decode_image(data: bytes):
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise MediaError("the image is empty (0 bytes)")
    if len(data) > MAX_IMAGE_BYTES:
        raise MediaError(f"the image is {len(data)} bytes; at most {MAX_IMAGE_BYTES} are accepted")
    try:
        image = Image.open(io.BytesIO(data))
        if image.format not in _FORMATS:
            raise MediaError(f"image format {image.format} is not supported; send one of {', '.join(_FORMATS)}")
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise MediaError(f"the image is {image.width}x{image.height} pixels; at most {MAX_IMAGE_PIXELS} in all")
        image.load()
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"the image could not be decoded ({type(e).__name__}: {e}); send a PNG or JPEG") from None
    return _check(image).convert("RGB")


def _check(image):
    if image.width < 1 or image.height < 1:
        raise MediaError(f"the image is empty ({image.width}x{image.height} pixels)")
    return image


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise MediaError("a data: URL image must be base64: data:image/png;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data: URL's payload is not valid base64") from None


def _read_local(path: str, allowed: Optional[str]) -> bytes:
    if not allowed:
        raise MediaError(
            f"local image {path!r}: reading local files is off; start with --allowed-local-media-path DIR "
            "(LLM(allowed_local_media_path=DIR)) to allow files under DIR, or send a data: URL"
        )
    root = os.path.realpath(allowed)
    full = os.path.realpath(path)
    if os.path.commonpath([root, full]) != root:
        raise MediaError(f"local image {path!r} is outside --allowed-local-media-path {allowed!r}")
    if not os.path.isfile(full):
        raise MediaError(f"local image {path!r} does not exist")
    if os.path.getsize(full) > MAX_IMAGE_BYTES:
        raise MediaError(f"local image {path!r} is larger than {MAX_IMAGE_BYTES} bytes")
    with open(full, "rb") as f:
        return f.read()
