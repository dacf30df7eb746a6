"""Image preprocessing without torch: what transformers' Qwen2VLImageProcessor (Pillow backend) and the
Qwen3VLProcessor do to an image chat, in numpy + Pillow, bit for bit.

An image is converted to RGB (transparency composited onto white), resized with Pillow's bicubic filter to the
`smart_resize` size (both sides multiples of patch x merge, pixel count inside [min_pixels, max_pixels]), rescaled
(uint8 -> float64 x 1/255 -> float32) and normalised ((x - mean) / std in float32), then cut into patches of
[3 channels, temporal_patch_size frames (the still image repeated), patch, patch], ordered so that every
merge x merge block of neighbouring patches is contiguous (the order the vision tower's merger consumes).
Every constant comes from the checkpoint's preprocessor_config.json and config.json `vision_config`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image


class PreprocessError(ValueError):
    """An image or a preprocessor config that cannot be processed."""


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float
    resample: int  # a PIL.Image.Resampling value (3 = bicubic)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def _checked_flags(pp: dict) -> None:
    """Only the pipeline the release uses is implemented; any other setting is refused rather than ignored."""
    for key, want in (("do_resize", True), ("do_rescale", True), ("do_normalize", True), ("do_convert_rgb", True)):
        if pp.get(key, want) is not want:
            raise PreprocessError(f"preprocessor_config.json: {key}={pp[key]!r} is not supported (only {want})")


def processor_config(preprocessor: dict, vision_config: dict) -> ImageProcessorConfig:
    """ImageProcessorConfig from preprocessor_config.json and config.json's vision_config (they must agree)."""
    _checked_flags(preprocessor)
    size = preprocessor.get("size") or {}
    min_pixels = preprocessor.get("min_pixels", size.get("shortest_edge"))
    max_pixels = preprocessor.get("max_pixels", size.get("longest_edge"))
    if min_pixels is None or max_pixels is None:
        raise PreprocessError("preprocessor_config.json: size.shortest_edge / size.longest_edge (pixel limits) missing")
    cfg = ImageProcessorConfig(
        patch_size=int(preprocessor.get("patch_size", vision_config["patch_size"])),
        temporal_patch_size=int(preprocessor.get("temporal_patch_size", vision_config["temporal_patch_size"])),
        merge_size=int(preprocessor.get("merge_size", vision_config["spatial_merge_size"])),
        min_pixels=int(min_pixels), max_pixels=int(max_pixels),
        image_mean=tuple(float(x) for x in preprocessor["image_mean"]),
        image_std=tuple(float(x) for x in preprocessor["image_std"]),
        rescale_factor=float(preprocessor.get("rescale_factor", 1 / 255)),
        resample=int(preprocessor.get("resample", Image.Resampling.BICUBIC)),
    )
    for ours, theirs in ((cfg.patch_size, "patch_size"), (cfg.temporal_patch_size, "temporal_patch_size"),
                         (cfg.merge_size, "spatial_merge_size")):
        if ours != vision_config[theirs]:
            raise PreprocessError(f"preprocessor_config.json and vision_config disagree on {theirs}")
    return cfg


def load_processor_config(path: str | Path) -> ImageProcessorConfig:
    """From a checkpoint directory (preprocessor_config.json + config.json)."""
    path = Path(path)
    if not (path / "preprocessor_config.json").is_file():
        raise PreprocessError(f"{path}: no preprocessor_config.json (the checkpoint has no image processor)")
    hf = json.loads((path / "config.json").read_text())
    if "vision_config" not in hf:
        raise PreprocessError(f"{path}/config.json has no vision_config")
    return processor_config(json.loads((path / "preprocessor_config.json").read_text()), hf["vision_config"])


PROCESSOR_KWARGS = ("min_pixels", "max_pixels", "size")  # what mm_processor_kwargs may set (vLLM's names)


def check_processor_kwargs_names(kwargs) -> None:
    """mm_processor_kwargs is a JSON object of PROCESSOR_KWARGS names (its values need the model's processor:
    `with_processor_kwargs`)."""
    if not isinstance(kwargs, dict):
        raise PreprocessError(f"mm_processor_kwargs must be a JSON object, got {kwargs!r}")
    unknown = sorted(set(kwargs) - set(PROCESSOR_KWARGS))
    if unknown:
        raise PreprocessError(f"mm_processor_kwargs: {', '.join(unknown)} not supported (supported: "
                              f"{', '.join(PROCESSOR_KWARGS)})")


def with_processor_kwargs(cfg: ImageProcessorConfig, kwargs: dict) -> ImageProcessorConfig:
    """The config with vLLM's `mm_processor_kwargs` applied: the resize bounds `min_pixels` / `max_pixels`, or
    transformers' `size` {"shortest_edge": min, "longest_edge": max}. Anything else is refused (not ignored)."""
    check_processor_kwargs_names(kwargs)
    size = kwargs.get("size") or {}
    if not isinstance(size, dict) or set(size) - {"shortest_edge", "longest_edge"}:
        raise PreprocessError(f"mm_processor_kwargs: size takes shortest_edge and longest_edge, got {size!r}")
    bounds = {"min_pixels": kwargs.get("min_pixels", size.get("shortest_edge", cfg.min_pixels)),
              "max_pixels": kwargs.get("max_pixels", size.get("longest_edge", cfg.max_pixels))}
    for name, value in bounds.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PreprocessError(f"mm_processor_kwargs: {name} must be a positive integer, got {value!r}")
    if bounds["min_pixels"] > bounds["max_pixels"]:
        raise PreprocessError(f"mm_processor_kwargs: min_pixels {bounds['min_pixels']} > max_pixels "
                              f"{bounds['max_pixels']}")
    if bounds["max_pixels"] < cfg.factor ** 2:
        raise PreprocessError(f"mm_processor_kwargs: max_pixels {bounds['max_pixels']} is below one merged patch "
                              f"({cfg.factor} x {cfg.factor} pixels)")
    return dataclasses.replace(cfg, **bounds)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, aspect ratio kept as closely as possible, pixels in range."""
    if max(height, width) / min(height, width) > 200:
        raise PreprocessError(f"absolute aspect ratio must be smaller than 200, got "
                              f"{max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (as transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def normalized_pixels(image: Image.Image, cfg: ImageProcessorConfig) -> np.ndarray:
    """Resized, rescaled and normalised pixels [3, H', W'] float32."""
    rgb = to_rgb(image)
    h, w = smart_resize(rgb.height, rgb.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    resized = np.asarray(rgb.resize((w, h), resample=cfg.resample), np.uint8).transpose(2, 0, 1)  # [3, h, w]
    scaled = (resized.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    mean = np.asarray(cfg.image_mean, np.float32)[:, None, None]
    std = np.asarray(cfg.image_std, np.float32)[:, None, None]
    return (scaled - mean) / std


def patchify(pixels: np.ndarray, cfg: ImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[3, H', W'] -> (patches [gh*gw, 3*T*P*P] float32 in merge-block order, grid (1, gh, gw))."""
    c, h, w = pixels.shape
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = h // p, w // p
    x = pixels.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # bh, bw, mh, mw, C, ph, pw
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))  # the still image as T frames
    return np.ascontiguousarray(x.reshape(gh * gw, c * t * p * p)), (1, gh, gw)


def preprocess_images(images: Sequence[Image.Image], cfg: ImageProcessorConfig) -> tuple[np.ndarray, np.ndarray]:
    """-> (pixel_values [sum of patches, 3*T*P*P] float32, image_grid_thw [n_images, 3] int64)."""
    if not images:
        raise PreprocessError("no images")
    patches, grids = zip(*(patchify(normalized_pixels(im, cfg), cfg) for im in images))
    return np.concatenate(patches, axis=0), np.asarray(grids, np.int64)


def image_token_counts(grid_thw: np.ndarray, merge_size: int) -> list[int]:
    """Pad tokens per image: t * gh * gw / merge^2 (one per merged patch)."""
    return [int(np.prod(g)) // merge_size**2 for g in np.asarray(grid_thw)]


def expand_image_tokens(token_ids: Sequence[int], grid_thw: np.ndarray, image_token_id: int,
                        merge_size: int) -> list[int]:
    """Each <|image_pad|> of a templated prompt -> that image's count of pad tokens (images in prompt order).

    The processor does this on the text before tokenizing; special tokens are split off before BPE, so expanding
    the ids is the same thing."""
    counts = image_token_counts(grid_thw, merge_size)
    n_pads = sum(1 for t in token_ids if t == image_token_id)
    if n_pads != len(counts):
        raise PreprocessError(f"the prompt has {n_pads} image placeholders but {len(counts)} images were given")
    out: list[int] = []
    images = iter(counts)
    for t in token_ids:
        out.extend([t] * next(images) if t == image_token_id else [t])
    return out
