"""Images' pure parts: prefix-block keys, placeholder-run checks, bounded decoding, the gateway's
data-URL parsing and gated URL fetches (a local HTTP server on loopback), limit parsing."""

from __future__ import annotations

import base64
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gateway.multimodal import MediaConfig, _image_bytes, parse_limit_mm_per_prompt
from pagoda.contract.image_inputs import ImageError, ImageLimits, decode_image
from pagoda.contract.multimodal import MultiModalInput, check_mm_inputs, mm_block_keys
from pagoda.contract.prefix_hash import block_extra_keys
from tests.multimodal.conftest import make_image, png_bytes


def item(offset: int, length: int, name: str = "h") -> MultiModalInput:
    return MultiModalInput(name, offset, length, b"", (3, 1, 1))


def test_block_keys_name_the_images_overlapping_each_block():
    items = (item(5, 6, "a"), item(11, 2, "b"))  # a: [5, 11), b: [11, 13)
    assert [mm_block_keys(items, i, 4) for i in range(4)] == [
        (), (("mm", "a"),), (("mm", "a"), ("mm", "b")), (("mm", "b"),)]
    # text-only keys are exactly what they were (cached blocks of text prompts keep their hashes)
    assert block_extra_keys(0, "salt", "lora") == ("salt", ("lora", "lora"))
    assert block_extra_keys(1, "salt", "lora") == ()
    assert block_extra_keys(0, "salt", None, (("mm", "a"),)) == ("salt", ("mm", "a"))


@pytest.mark.parametrize("items", [(item(2, 0),), (item(8, 4),), (item(0, 4), item(3, 2))])
def test_placeholder_runs_must_be_nonempty_ordered_and_inside(items):
    with pytest.raises(ValueError):
        check_mm_inputs(items, 10)
    check_mm_inputs((item(0, 4), item(4, 2)), 10)


def test_decode_image_refuses_bad_data():
    whole = png_bytes(make_image(1))
    assert decode_image(whole).size == (80, 64)
    with pytest.raises(ImageError, match="not an image"):
        decode_image(b"hello")
    with pytest.raises(ImageError, match="cannot be decoded"):
        decode_image(whole[:len(whole) // 2])
    with pytest.raises(ImageError, match="pixels"):
        decode_image(whole, ImageLimits(max_pixels=1000))
    with pytest.raises(ImageError, match="bytes"):
        decode_image(whole, ImageLimits(max_bytes=100))


def test_limit_mm_per_prompt_is_vllms_json():
    assert parse_limit_mm_per_prompt('{"image": 2}') == 2
    assert parse_limit_mm_per_prompt(None) == 4
    for bad in ('{"video": 1}', "2", "{"):
        with pytest.raises(ValueError):
            parse_limit_mm_per_prompt(bad)


class _Images(BaseHTTPRequestHandler):
    body = png_bytes(make_image(2))

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        found = self.path == "/cat.png"
        self.send_response(200 if found else 404)
        self.end_headers()
        self.wfile.write(self.body if found else b"")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


async def test_urls_are_fetched_only_from_allowed_domains(image_server):
    allowed = MediaConfig(allowed_media_domains=("127.0.0.1",))
    assert await _image_bytes(f"{image_server}/cat.png", allowed) == _Images.body
    with pytest.raises(ImageError, match="refused"):
        await _image_bytes(f"{image_server}/cat.png", MediaConfig())
    with pytest.raises(ImageError, match="HTTP 404"):
        await _image_bytes(f"{image_server}/dog.png", allowed)
    with pytest.raises(ImageError, match="HTTP 302"):  # a redirect could leave the allow-list
        await _image_bytes(f"{image_server}/moved", allowed)
    small = MediaConfig(allowed_media_domains=("127.0.0.1",), limits=ImageLimits(max_bytes=100))
    with pytest.raises(ImageError, match="over 100 bytes"):
        await _image_bytes(f"{image_server}/cat.png", small)
    with pytest.raises(ImageError, match="base64"):
        await _image_bytes("data:image/png;base64,@@@", allowed)
    with pytest.raises(ImageError, match="data URL or http"):
        await _image_bytes("file:///etc/passwd", allowed)
    encoded = base64.b64encode(_Images.body).decode()
    assert await _image_bytes(f"data:image/png;base64,{encoded}", MediaConfig()) == _Images.body


def test_chunks_stop_before_an_image_the_encoder_budget_cannot_pay():
    from scheduler_svc.core.step_draft import cut_for_encoder

    items = (item(4, 16, "a"), item(24, 16, "b"))
    assert cut_for_encoder(items, 0, 64, 32, 32) == (64, 32)  # both fit
    assert cut_for_encoder(items, 0, 64, 16, 32) == (24, 16)  # stops before b
    assert cut_for_encoder(items, 0, 64, 8, 32) == (4, 0)  # stops before a
    assert cut_for_encoder(items, 4, 64, 8, 32) == (0, 0)  # starts at a: waits for a later step
    assert cut_for_encoder(items, 4, 64, 8, 8) == (20, 16)  # ... unless nothing was encoded this step
    assert cut_for_encoder(items, 10, 10, 0, 32) == (10, 0)  # a begun image is cached: free


def test_the_router_keys_blocks_by_image_as_the_scheduler_does():
    from gateway.upstream.routing import routing_key
    from pagoda.v1 import common_pb2

    ids = list(range(16))
    image = [common_pb2.MultiModalInput(hash="a", offset=4, length=8)]  # blocks 1 and 2 of 4 tokens
    assert routing_key(ids, "", 4, 1, None, image) == routing_key(ids, "", 4, 1)  # block 0: text only
    assert routing_key(ids, "", 4, 3, None, image) != routing_key(ids, "", 4, 3)
    other = [common_pb2.MultiModalInput(hash="b", offset=4, length=8)]
    assert routing_key(ids, "", 4, 3, None, image) != routing_key(ids, "", 4, 3, None, other)
