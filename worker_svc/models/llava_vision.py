"""LLaVA's image side: the vision tower (CLIP / SigLIP) and the multimodal projector.

The tower and projector are transformers' own modules (built from the checkpoint's `vision_config`,
weights read from its safetensors), not a re-implementation: they run once per image (cached by
hash, worker_svc/multimodal.py), never per token, so their speed matters far less than being exactly
HF's. The language model stays Pagoda's (models/llama.py), loaded from `text_config`.

    vision = LlavaVision.load("models/pagoda-tiny-llava", torch.float32, torch.device("cpu"))
    rows = vision.encode(pixel_values)  # [N, 3, H, W] -> [N, tokens per image, text hidden]
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

# Checkpoint prefixes of the tower and projector (llava-hf's, and transformers 5's in-memory names).
_TOWER = ("vision_tower.", "model.vision_tower.")
_PROJECTOR = ("multi_modal_projector.", "model.multi_modal_projector.")


class LlavaVision(nn.Module):
    def __init__(self, config) -> None:  # config: transformers.LlavaConfig
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        super().__init__()
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        layer = config.vision_feature_layer
        if not isinstance(layer, int):
            raise ValueError("a list of vision_feature_layer values is not supported yet")
        self.feature_layer = layer
        self.select_strategy = config.vision_feature_select_strategy  # "default" drops CLS

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> LlavaVision:
        from transformers import LlavaConfig

        model_dir = Path(model_dir)
        vision = cls(LlavaConfig.from_pretrained(model_dir))
        vision.load_state_dict(_vision_state(model_dir, vision), strict=True)
        return vision.to(device=device, dtype=dtype).eval().requires_grad_(False)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [N, 3, H, W] -> [N, patches (- CLS), text hidden], as HF's get_image_features
        out = self.vision_tower(pixel_values, output_hidden_states=True)
        features = out.hidden_states[self.feature_layer]  # [N, 1 + patches, vision hidden]
        if self.select_strategy == "default":
            features = features[:, 1:]
        return self.multi_modal_projector(features)


def is_llava(model_dir: str | Path) -> bool:
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return False
    return "LlavaForConditionalGeneration" in (json.loads(config.read_text()).get("architectures") or ())


def _vision_state(model_dir: Path, module: LlavaVision) -> dict[str, torch.Tensor]:
    """The tower's and projector's tensors, renamed to `module`'s parameter names. llava-hf nests
    the tower one level deeper (`vision_tower.vision_model.`) than transformers 5 saves it."""
    wanted = set(module.state_dict())
    state: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt", device="cpu") as reader:
            for name in reader.keys():
                target = _target(name, wanted)
                if target is not None:
                    state[target] = reader.get_tensor(name)
    return state


def _target(name: str, wanted: set[str]) -> str | None:
    for prefixes, into in ((_TOWER, "vision_tower."), (_PROJECTOR, "multi_modal_projector.")):
        for prefix in prefixes:
            if name.startswith(prefix):
                rest = name[len(prefix):]
                for candidate in (into + rest, into + rest.removeprefix("vision_model."),
                                  into + "vision_model." + rest):
                    if candidate in wanted:
                        return candidate
                return None
    return None
