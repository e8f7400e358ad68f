"""Images into a prompt: decode (bounded), preprocess with the model's own HF processor, expand each
placeholder token into the image's token run. Shared by the gateway and the offline `LLM`.

The prompt is rendered and tokenized as text first (the chat template writes one placeholder token,
e.g. LLaVA's `<image>`, per image part); `expand` then replaces the i-th placeholder with
`length` copies and records where they are (MultiModalInput.offset), so the number of image
tokens, and so the prompt length the scheduler admits, is known before anything is encoded.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagoda.contract.multimodal import MultiModalInput, content_hash

MULTIMODAL_ARCHITECTURES = ("LlavaForConditionalGeneration",)


class ImageError(ValueError):
    """An image that cannot be served (not an image, truncated, too large): the caller's 400."""


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_bytes: int = 20 << 20  # encoded size
    max_pixels: int = 4096 * 4096  # width * height once decoded (a decompression bomb is refused)


def decode_image(data: bytes, limits: ImageLimits = ImageLimits()) -> Any:
    """Encoded bytes -> a fully decoded RGB PIL image, or ImageError saying why not."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageError(f"the image is {len(data)} bytes; the limit is {limits.max_bytes}")
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > limits.max_pixels:
            raise ImageError(f"the image is {image.width}x{image.height} pixels; the limit is "
                             f"{limits.max_pixels} pixels")
        image.load()  # decodes now: a truncated file fails here, not in the processor
        return image.convert("RGB")
    except UnidentifiedImageError:
        raise ImageError("not an image (PIL cannot identify the data)") from None
    except (OSError, SyntaxError, Image.DecompressionBombError) as error:
        raise ImageError(f"the image cannot be decoded: {error}") from None


class ImageProcessor:
    """A vision-language model's image side as the prompt sees it (LLaVA-style: one run of image
    tokens per image, `tokens_per_image` from the processed pixels' size)."""

    def __init__(self, hf_processor: Any, image_token_id: int, patch_size: int, extra_tokens: int) -> None:
        self.hf = hf_processor  # transformers' image processor (CLIPImageProcessor, ...)
        self.image_token_id = image_token_id
        self.patch_size = patch_size
        self.extra_tokens = extra_tokens  # CLS kept (+1) or dropped (0) by the feature strategy

    @classmethod
    def load(cls, model_dir: str | Path) -> ImageProcessor | None:
        """None for a text-only model (or a GGUF file)."""
        config_file = Path(model_dir) / "config.json"
        if not config_file.is_file():
            return None
        config = json.loads(config_file.read_text())
        if not any(a in MULTIMODAL_ARCHITECTURES for a in config.get("architectures") or ()):
            return None
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(str(model_dir))
        vision = config.get("vision_config") or {}
        extra = _num_additional_tokens(Path(model_dir), vision)
        if config.get("vision_feature_select_strategy", "default") == "default":
            extra -= 1  # "default" drops the CLS row
        return cls(processor, int(config["image_token_index"]), int(vision.get("patch_size", 14)), extra)

    def preprocess(self, image: Any) -> tuple[bytes, tuple[int, ...]]:
        """One PIL image -> its pixel values (float32 bytes) and their shape [3, H, W]."""
        pixels = self.hf([image], return_tensors="np")["pixel_values"][0]
        pixels = np.ascontiguousarray(pixels, dtype="<f4")
        return pixels.tobytes(), tuple(int(d) for d in pixels.shape)

    def tokens_per_image(self, shape: Sequence[int]) -> int:
        height, width = shape[-2], shape[-1]
        return (height // self.patch_size) * (width // self.patch_size) + self.extra_tokens

    def expand(self, prompt_ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], tuple[MultiModalInput, ...]]:
        """Each placeholder of `prompt_ids` (one per image, in order) -> that image's token run."""
        marks = [i for i, t in enumerate(prompt_ids) if t == self.image_token_id]
        if len(marks) != len(images):
            raise ImageError(f"the prompt has {len(marks)} image placeholders for {len(images)} images")
        out: list[int] = []
        items: list[MultiModalInput] = []
        last = 0
        for mark, image in zip(marks, images, strict=True):
            pixels, shape = self.preprocess(image)
            out.extend(prompt_ids[last:mark])
            length = self.tokens_per_image(shape)
            items.append(MultiModalInput(content_hash(pixels, shape), len(out), length, pixels, shape))
            out.extend([self.image_token_id] * length)
            last = mark + 1
        out.extend(prompt_ids[last:])
        return out, tuple(items)


def _num_additional_tokens(model_dir: Path, vision: dict) -> int:
    """The processor config's num_additional_image_tokens (CLIP's CLS: 1); else by tower type."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        file = model_dir / name
        if file.is_file():
            value = json.loads(file.read_text()).get("num_additional_image_tokens")
            if value is not None:
                return int(value)
    return 0 if vision.get("model_type") == "siglip_vision_model" else 1
