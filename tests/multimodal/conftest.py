"""A generated tiny LLaVA (pagoda.tools.tiny_llava), HF's reference model on it, and test images."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from pagoda.tools import tiny_llava


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("llava") / "pagoda-tiny-llava"
    tiny_llava.write_model(out)
    return str(out)


@pytest.fixture(scope="session")
def hf_llava(llava_dir):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()


def make_image(seed: int, size: tuple[int, int] = (80, 64)):
    """A random RGB PIL image (width, height); different seeds give different embeddings."""
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
