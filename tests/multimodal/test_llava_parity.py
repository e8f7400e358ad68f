"""Greedy parity with HF `LlavaForConditionalGeneration.generate` on the tiny LLaVA, through the
offline LLM (the services' scheduler core and model runner): one and two images per prompt, chunked
prefill cutting through an image, a cramped pool (preemption), and image-aware prefix caching."""

from __future__ import annotations

import pytest
import torch

from pagoda.contract.params import SamplingParams
from pagoda.entrypoints.llm import LLM
from pagoda.tools.tiny_llava import IMAGE_TOKEN_ID, NUM_IMAGE_TOKENS
from tests.multimodal.conftest import make_image

MAX_TOKENS = 12
PROMPT_1 = "<|im_start|>user\n<image>Describe the picture.<|im_end|>\n<|im_start|>assistant\n"
PROMPT_2 = "<|im_start|>user\nFirst <image> then <image> compare them.<|im_end|>\n<|im_start|>assistant\n"


def hf_greedy(hf_llava, llava_dir, prompt: str, images: list) -> tuple[list[int], list[int]]:
    """(HF processor's prompt ids, HF's greedy continuation)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(llava_dir)
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    with torch.no_grad():
        out = hf_llava.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run(llm: LLM, prompt: str, images: list):
    return llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, greedy(), use_tqdm=False)[0]


@pytest.fixture(scope="module")
def cases(hf_llava, llava_dir):
    one = [make_image(1)], [make_image(2)]
    two = [make_image(3), make_image(4, (40, 90))]
    return {
        "one_a": (PROMPT_1, one[0], *hf_greedy(hf_llava, llava_dir, PROMPT_1, one[0])),
        "one_b": (PROMPT_1, one[1], *hf_greedy(hf_llava, llava_dir, PROMPT_1, one[1])),
        "two": (PROMPT_2, two, *hf_greedy(hf_llava, llava_dir, PROMPT_2, two)),
    }


def test_images_steer_the_reference(cases):
    # Otherwise parity would prove nothing about the splice.
    assert cases["one_a"][3] != cases["one_b"][3]


@pytest.mark.parametrize("max_batched, block_size", [(2048, 16), (7, 4)])
def test_greedy_matches_hf(llava_dir, cases, max_batched, block_size):
    # (7, 4): every prefill chunk is 7 tokens, so chunks start and end inside each image's run.
    with LLM(llava_dir, device="cpu", dtype="float32", block_size=block_size,
             max_num_batched_tokens=max_batched, enable_prefix_caching=False) as llm:
        for name, (prompt, images, hf_ids, hf_out) in cases.items():
            out = run(llm, prompt, images)
            assert out.prompt_token_ids == hf_ids, name
            assert out.prompt_token_ids.count(IMAGE_TOKEN_ID) == NUM_IMAGE_TOKENS * len(images)
            assert out.outputs[0].token_ids == hf_out, name


def test_cramped_pool_batch_matches_hf(llava_dir, cases):
    # 3 requests of 33, 33 and 57 prompt tokens (+12) in 18 blocks of 4 tokens (the largest alone
    # needs 18): they preempt each other and resume (images sent again, served from the encoder cache).
    names = list(cases)
    with LLM(llava_dir, device="cpu", dtype="float32", block_size=4, num_gpu_blocks_override=18,
             max_num_batched_tokens=128, enable_prefix_caching=False) as llm:
        prompts = [{"prompt": cases[n][0], "multi_modal_data": {"image": cases[n][1]}} for n in names]
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
        assert llm.stats().num_preemptions > 0
    for name, out in zip(names, outs, strict=True):
        assert out.outputs[0].token_ids == cases[name][3], name


def test_prefix_cache_keys_include_the_image(llava_dir, cases):
    prompt, image_a, ids_a, out_a = cases["one_a"]
    _, image_b, _, out_b = cases["one_b"]
    offset = ids_a.index(IMAGE_TOKEN_ID)  # the image starts in block offset // 4
    with LLM(llava_dir, device="cpu", dtype="float32", block_size=4, enable_prefix_caching=True) as llm:
        first = run(llm, prompt, image_a)
        assert first.num_cached_tokens == 0
        same = run(llm, prompt, image_a)
        # every full block but the last token's: (len - 1) // 4 blocks
        assert same.num_cached_tokens == (len(ids_a) - 1) // 4 * 4
        assert same.outputs[0].token_ids == out_a
        other = run(llm, prompt, image_b)
        # only the text blocks wholly before the image are shared
        assert other.num_cached_tokens == offset // 4 * 4
        assert other.outputs[0].token_ids == out_b
        encoder = llm.runner.mm.cache
        assert encoder.num_encoded == 2  # image_a once (the hit never re-encoded it), image_b once
        stats = llm.stats()  # what the services export as pagoda:encoder_tokens / _cache_hits
        assert (stats.encoder_tokens, stats.encoder_cache_hits) == (2 * NUM_IMAGE_TOKENS, 0)


def test_swap_preemption_matches_hf(llava_dir, cases):
    # Swapped-out requests resume as new ones whose KV (image rows included) comes back from the host.
    names = list(cases)
    with LLM(llava_dir, device="cpu", dtype="float32", block_size=4, num_gpu_blocks_override=18,
             max_num_batched_tokens=128, enable_prefix_caching=False, preemption_mode="swap",
             swap_space=64 * 4 * 2 * 2 * 64 * 4 / (1 << 30)) as llm:
        prompts = [{"prompt": cases[n][0], "multi_modal_data": {"image": cases[n][1]}} for n in names]
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
        assert llm.stats().num_swap_preemptions > 0
    for name, out in zip(names, outs, strict=True):
        assert out.outputs[0].token_ids == cases[name][3], name


def test_mixed_soak_leaks_no_blocks_or_encoder_entries(llava_dir):
    # 60 requests: text only, one image (8 distinct images, so the 4-entry encoder cache evicts),
    # the same image again (prefix hits), on a pool small enough to preempt.
    text = "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"
    prompts = [{"prompt": text} if i % 3 == 0 else
               {"prompt": PROMPT_1, "multi_modal_data": {"image": [make_image(100 + i % 8)]}}
               for i in range(60)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(llava_dir, device="cpu", dtype="float32", block_size=4, num_gpu_blocks_override=40,
             max_num_batched_tokens=64, max_num_seqs=8) as llm:
        llm.runner.mm.cache.capacity = 4
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
        llm.scheduler.check_invariants()
        stats = llm.stats()
        assert stats.num_used_blocks == 0 and stats.num_running == stats.num_waiting == 0
        assert stats.num_free_blocks + stats.num_evictable_blocks == 40
        assert len(llm.runner.mm.cache) <= 4
        assert llm.runner.mm.cache.num_encoded >= 8  # every distinct image at least once
    # each image prompt's answer depends only on its image (identical prompts, identical answers)
    by_image: dict[int, list[int]] = {}
    for i, out in enumerate(outs):
        if i % 3:
            assert by_image.setdefault(i % 8, out.outputs[0].token_ids) == out.outputs[0].token_ids


@pytest.mark.parametrize("encoder_budget, most_per_step", [(0, 4 * NUM_IMAGE_TOKENS), (NUM_IMAGE_TOKENS, NUM_IMAGE_TOKENS)])
def test_encoder_budget_bounds_the_images_encoded_per_step(llava_dir, cases, encoder_budget, most_per_step):
    # The batch's first step holds 4 images (1 + 1 + 2); with a 16-row budget each step encodes one,
    # chunks stopping right before the image the step cannot pay, and the answers do not change.
    names = list(cases)
    with LLM(llava_dir, device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=2048,
             long_prefill_token_threshold=2048, enable_prefix_caching=False,
             max_num_encoder_input_tokens=encoder_budget) as llm:
        per_step: list[int] = []
        execute = llm.runner.execute

        def recording(plan):
            named = llm.scheduler.stats().last_step_images  # what the step's trace span names
            result = execute(plan)
            per_step.append(result.num_encoder_tokens)
            assert len(named) * NUM_IMAGE_TOKENS == result.num_encoder_tokens
            return result

        llm.runner.execute = recording
        prompts = [{"prompt": cases[n][0], "multi_modal_data": {"image": cases[n][1]}} for n in names]
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert max(per_step) == most_per_step and sum(per_step) == 4 * NUM_IMAGE_TOKENS
    for name, out in zip(names, outs, strict=True):
        assert out.outputs[0].token_ids == cases[name][3], name


def test_tensor_parallel_matches_hf(llava_dir, cases):
    # TP=2: the language model's heads and MLP are sharded; every rank runs the (replicated) vision
    # tower on the images the broadcast plan carries, and 7-token chunks cut through them.
    with LLM(llava_dir, device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=7,
             enable_prefix_caching=False, tensor_parallel_size=2) as llm:
        for name, (prompt, images, _, hf_out) in cases.items():
            assert run(llm, prompt, images).outputs[0].token_ids == hf_out, name


def test_llm_chat_takes_image_parts(llava_dir, cases):
    import base64

    from tests.multimodal.conftest import png_bytes

    _, images, hf_ids, hf_out = cases["one_a"]
    url = "data:image/png;base64," + base64.b64encode(png_bytes(images[0])).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Describe the picture."}]}]
    with LLM(llava_dir, device="cpu", dtype="float32") as llm:
        out = llm.chat(messages, greedy(), use_tqdm=False)[0]
        assert out.prompt_token_ids == hf_ids and out.outputs[0].token_ids == hf_out
        pil = [{"role": "user", "content": [{"type": "image_pil", "image_pil": images[0]},
                                            {"type": "text", "text": "Describe the picture."}]}]
        assert llm.chat(pil, greedy(), use_tqdm=False)[0].outputs[0].token_ids == hf_out
        with pytest.raises(ValueError, match="messages\\[0\\].content\\[0\\]: offline"):
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y"}}]}])


def test_a_text_model_refuses_images(tmp_path_factory):
    from pagoda.contract.errors import PlanError
    from pagoda.contract.multimodal import MultiModalInput
    from pagoda.tools import tiny_model
    from scheduler_svc.core.request import EngineRequest

    text_model = tmp_path_factory.mktemp("text") / "tiny"
    tiny_model.write_model(text_model)
    with LLM(str(text_model), device="cpu", dtype="float32") as llm:
        with pytest.raises(ValueError, match="not a vision-language model"):
            llm.generate({"prompt_token_ids": [5, 6, 7], "multi_modal_data": {"image": [make_image(1)]}})
        # a request that reached the scheduler anyway (a gRPC client of the engine) fails the plan
        image = MultiModalInput("h", 1, 1, b"\0" * 12, (3, 1, 1))
        llm.scheduler.add_request(EngineRequest("x", (5, 6, 7), greedy(), mm_inputs=(image,)))
        with pytest.raises(PlanError, match="not a vision-language model"):
            llm.runner.execute(llm.scheduler.schedule())


def test_siglip_tower_and_qwen2_language_model_match_hf(tmp_path_factory):
    # The other common LLaVA build: a SigLIP tower (no CLS token, strategy "full") under a Qwen2
    # language model (q/k/v biases), with chunks cutting through both images.
    from transformers import LlavaForConditionalGeneration

    from pagoda.tools import tiny_llava

    model_dir = str(tmp_path_factory.mktemp("siglip") / "tiny-llava-siglip-qwen2")
    tiny_llava.write_model(model_dir, variant="siglip-qwen2")
    hf = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    images = [make_image(7), make_image(8, (50, 70))]
    hf_ids, hf_out = hf_greedy(hf, model_dir, PROMPT_2, images)
    assert hf_ids.count(IMAGE_TOKEN_ID) == 2 * NUM_IMAGE_TOKENS
    with LLM(model_dir, device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=7) as llm:
        out = run(llm, PROMPT_2, images)
        assert out.prompt_token_ids == hf_ids and out.outputs[0].token_ids == hf_out
