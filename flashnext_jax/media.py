"""Images as OpenAI-style chat messages carry them, loaded under an engine's limits (`LLM.chat`, the server).

Both `LLM.chat` and `/v1/chat/completions` read messages through `chat_inputs`, so an image chat means the same
thing offline and online. A content part is `{"type": "text", "text": ...}`, `{"type": "image_url", "image_url":
{"url": ...}}` (OpenAI's; the url a `data:image/...;base64,...` URL, or http(s) from an allowed domain) or, offline,
vLLM's `{"type": "image_pil", "image_pil": PIL.Image}`.

The limits act before the expensive part, since the input is untrusted: the image count before any image is
decoded, an image's encoded bytes before they are decoded or downloaded whole (a data: URL's size from its base64
length, a download's from its Content-Length and then from what has arrived), an image's pixel count from its
header before its pixels are (a small PNG can declare a huge canvas), and http(s) URLs only from domains the
operator names (a server may have no network, and fetching any URL a client sends lets clients probe the server's
network).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import warnings
from typing import Any
from urllib.parse import urlsplit

from PIL import Image

# Pillow's own decompression-bomb threshold (it warns above it and refuses above twice it): the default pixel cap
DEFAULT_MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485
# OpenAI's limit on one image's encoded size (20 MB per image in its vision guide): the default byte cap
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024


class MediaError(ValueError):
    """An image input that is malformed or outside the limits (the server answers 400)."""


@dataclasses.dataclass(frozen=True)
class MediaLimits:
    """What image input an engine takes. `max_images`: per prompt (vLLM's limit_mm_per_prompt["image"]);
    `refusal`: why this engine takes no images at all (no vision tower), None when it takes them;
    `max_pixels`: of one image as decoded, before the processor resizes it; `max_image_bytes`: of one image as
    encoded (a data: URL's decoded payload, an http(s) download); `allowed_domains`: hosts http(s) image URLs may
    name (empty: none, only data: URLs)."""
    max_images: int
    refusal: str | None = None
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    allowed_domains: frozenset[str] = frozenset()
    fetch_timeout_s: float = 10.0

    def check_count(self, n: int) -> None:
        if n and self.refusal is not None:
            raise MediaError(self.refusal)
        if n > self.max_images:
            raise MediaError(f"at most {self.max_images} image(s) may be provided in one prompt, got {n} "
                             "(--limit-mm-per-prompt)")

    def check_bytes(self, n: int, where: str, what: str) -> None:
        """n: an image's encoded bytes, or those of it seen so far; what: how the message names them."""
        if n > self.max_image_bytes:
            raise MediaError(f"{where}: {what} {n} bytes, more than the {self.max_image_bytes} allowed for one image "
                             "(--max-image-bytes)")

    def check_size(self, image: Image.Image, where: str = "image") -> None:
        if not isinstance(image, Image.Image):
            raise MediaError(f"{where}: expected a PIL image, got {type(image).__name__}")
        w, h = image.size
        if w * h > self.max_pixels:
            raise MediaError(f"{where}: {w}x{h} = {w * h} pixels, more than the {self.max_pixels} allowed "
                             "(--max-image-pixels)")


def image_limit(limit_mm_per_prompt: dict | None) -> int | None:
    """vLLM's limit_mm_per_prompt ({"image": N} or {"image": {"count": N}}) -> the image count, None if unset.
    Other modalities may only be limited to 0 (this engine reads text and images)."""
    def count(modality: str, value: Any) -> int:
        if isinstance(value, dict):
            if set(value) != {"count"}:
                raise ValueError(f"limit_mm_per_prompt[{modality!r}]: only 'count' is supported, got {sorted(value)}")
            value = value["count"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be a count >= 0, got {value!r}")
        return value

    if limit_mm_per_prompt is None:
        return None
    for modality, value in limit_mm_per_prompt.items():
        if modality != "image" and count(modality, value) != 0:
            raise ValueError(f"limit_mm_per_prompt: this engine takes images only, not {modality!r}")
    return count("image", limit_mm_per_prompt["image"]) if "image" in limit_mm_per_prompt else None


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image_url", "image_pil")


def chat_inputs(messages: list[dict], limits: MediaLimits) -> tuple[list[dict], list[Image.Image]]:
    """OpenAI-style messages -> (the messages as the chat template reads them, their images in message and part
    order: the order the template renders their placeholders). A content list of text parts only is joined into
    one string (what templates without content parts expect); a list with images keeps its parts, each image as
    {"type": "image"} (the Hugging Face convention: Qwen templates render it as <|vision_start|><|image_pad|>
    <|vision_end|>). Raises MediaError (a ValueError) naming the part."""
    n = sum(_is_image_part(p) for m in messages if isinstance(m.get("content"), list) for p in m["content"])
    limits.check_count(n)
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise MediaError(f"{where}: a text part needs 'text', a string")
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise MediaError(f"{where}: an image_url part needs 'image_url': {{'url': 'data:...'}}")
                images.append(load_image_url(url, limits, where))
                parts.append({"type": "image"})
            elif kind == "image_pil":
                image = part["image_pil"]
                if not isinstance(image, Image.Image):
                    raise MediaError(f"{where}: image_pil must be a PIL image, got {type(image).__name__}")
                limits.check_size(image, where)
                images.append(image)
                parts.append({"type": "image"})
            else:
                raise MediaError(f"{where}: content part type {kind!r} is not supported "
                                 "(text, image_url, image_pil)")
        text_only = all(p["type"] == "text" for p in parts)
        out.append({**message, "content": "".join(p["text"] for p in parts) if text_only else parts})
    return out, images


def load_image_url(url: str, limits: MediaLimits, where: str = "image_url") -> Image.Image:
    """A data: URL (base64), or an http(s) URL of an allowed domain (fetched with httpx) -> the decoded image."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_image(_data_url_bytes(url, limits, where), limits, where)
    if scheme in ("http", "https"):
        return decode_image(_fetch(url, limits, where), limits, where)
    raise MediaError(f"{where}: unsupported image URL scheme {scheme or url[:16]!r}: send a "
                     "data:image/...;base64,... URL (or http(s) from a domain in --allowed-media-domains)")


def _data_url_bytes(url: str, limits: MediaLimits, where: str) -> bytes:
    comma = url.find(",")
    media_type, *params = url[len("data:"):comma if comma >= 0 else len(url)].split(";")
    if comma < 0 or "base64" not in params:
        raise MediaError(f"{where}: a data: URL must be base64 (data:image/png;base64,...)")
    if not media_type.lower().startswith("image/"):
        raise MediaError(f"{where}: the data: URL's media type {media_type!r} is not an image type")
    # the decoded size from the payload's length, before the payload is copied or decoded
    padding = 2 if url.endswith("==") else 1 if url.endswith("=") else 0
    limits.check_bytes((len(url) - comma - 1) * 3 // 4 - padding, where, "the data: URL's image is")
    try:
        return base64.b64decode(url[comma + 1:], validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{where}: the data: URL's payload is not valid base64") from None


def _fetch(url: str, limits: MediaLimits, where: str) -> bytes:
    host = (urlsplit(url).hostname or "").lower()
    if not limits.allowed_domains:
        raise MediaError(f"{where}: http(s) image URLs are not fetched by this server: send the image as a "
                         "data:image/...;base64,... URL (or start the server with --allowed-media-domains)")
    if host not in limits.allowed_domains:
        raise MediaError(f"{where}: the domain {host!r} is not in --allowed-media-domains")
    import httpx

    try:  # no redirects: a redirect could leave the allowed domains
        with httpx.stream("GET", url, timeout=limits.fetch_timeout_s, follow_redirects=False) as response:
            response.raise_for_status()
            declared = response.headers.get("content-length", "")
            if declared.isdigit():  # refused before any of the body is read
                limits.check_bytes(int(declared), where, "the image's Content-Length is")
            data = bytearray()
            for chunk in response.iter_bytes():  # a server may omit Content-Length or send more than it says
                data += chunk
                limits.check_bytes(len(data), where, "the image's download was stopped at")
    except httpx.HTTPError as e:
        raise MediaError(f"{where}: fetching the image failed: {e}") from None
    return bytes(data)


def decode_image(data: bytes, limits: MediaLimits, where: str = "image") -> Image.Image:
    """Encoded bytes -> a decoded image, its size checked from the header before the pixels are decoded."""
    try:
        with warnings.catch_warnings():  # our own pixel cap decides; Pillow's bomb warning would only be noise
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise MediaError(f"{where}: the image is too large to decode (Pillow's decompression-bomb limit)") from None
    except Exception as e:  # Pillow raises many kinds on malformed input; all of them are bad input here
        raise MediaError(f"{where}: not a decodable image ({type(e).__name__}: {e})") from None
    limits.check_size(image, where)
    try:
        image.load()
    except Exception as e:
        raise MediaError(f"{where}: the image data is corrupt ({type(e).__name__}: {e})") from None
    return image
