"""Image inputs on the server: loading image URLs under the media policy (data, file://, http(s) from allowed hosts,
with byte, pixel and time limits), chat `image_url` and Responses `input_image` parts, the limit per prompt, a
text-only model refusing images, and loading off the event loop. Every refusal is a 400 naming it, and the next
request is served."""

from __future__ import annotations

import base64
import http.server
import io
import json
import os
import threading
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from PIL import Image

from llmplug import LLM, AsyncLLM, SamplingParams
from llmplug.core.errors import InvalidRequestError
from llmplug.core.outputs import RequestOutput
from llmplug.entrypoints.openai.api_server import ServerSettings
from llmplug.multimodal.media import MediaPolicy, decode_image, load_image_url
from llmplug.testing.multimodal import processor_inputs
from tests.entrypoints.openai.conftest import RunningServer, serve
from tests.entrypoints.openai.test_errors import assert_openai_error, post
from tests.multimodal.conftest import images, tiny_llava  # noqa: F401 - fixtures: the tiny LLaVA and its pictures
from tests.multimodal.test_vlm_lora import save_adapter

CHAT = "/v1/chat/completions"
SLOW_SECONDS = 2.0


def encoded(size: tuple[int, int] = (12, 8), fmt: str = "PNG", mode: str = "RGB", noise: bool = False) -> bytes:
    """An image file's bytes; `noise` makes the pixel data large (a truncated copy then cuts into it)."""
    if noise:
        image = Image.frombytes("RGB", size, os.urandom(size[0] * size[1] * 3))
    else:
        image = Image.new(mode, size, (200, 30, 60, 128)[: len(mode)] if mode != "L" else 90)
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


# --- a local image host ---------------------------------------------------------------------------


class _ImageHost(http.server.BaseHTTPRequestHandler):
    """GET /ok.png, /slow?s=SECONDS (then not an image), /big (declared length), /drip-big (no declared length),
    /redirect?to=URL, /notimage, /missing."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urllib.parse.urlparse(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        if url.path == "/ok.png":
            self._send(encoded((20, 10)))
        elif url.path == "/slow":
            time.sleep(float(query.get("s", SLOW_SECONDS)))
            self._send(b"not an image after all")
        elif url.path == "/big":
            self._send(b"\0" * 50_000)
        elif url.path == "/drip-big":  # no Content-Length: the reader must stop by counting
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(50):
                self.wfile.write(b"\0" * 2000)
        elif url.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", query["to"])
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif url.path == "/notimage":
            self._send(b"<html>hello</html>")
        else:
            self.send_error(404)

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # a client that stops reading (the byte cap, the timeout) is what the tests do on purpose


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """http://127.0.0.1:PORT of a local image host, for the module."""
    httpd = _QuietServer(("127.0.0.1", 0), _ImageHost)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    """A folder of images (the allowed local media path) beside a secret one outside it."""
    root = tmp_path_factory.mktemp("media")
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(encoded((16, 16)))
    (root / "secret.png").write_bytes(encoded((4, 4)))
    (allowed / "escape.png").symlink_to(root / "secret.png")
    return allowed


def policy_for(media_dir: Path, **limits) -> MediaPolicy:
    return MediaPolicy(allowed_local_media_path=media_dir.resolve(), allowed_media_domains=frozenset({"127.0.0.1"}),
                       **limits)


def refused(url: str, policy: MediaPolicy, *words: str) -> str:
    """The message of the InvalidRequestError loading `url` raises; it names the part and holds `words`."""
    with pytest.raises(InvalidRequestError) as info:
        load_image_url(url, policy, "messages[0].content[1]")
    message = str(info.value)
    assert message.startswith("messages[0].content[1]: ") and info.value.param == "messages[0].content[1]"
    for word in words:
        assert word in message, message
    return message


# --- loading: data URLs and decoding ----------------------------------------------------------------


@pytest.mark.parametrize("fmt,media_type", [("PNG", "image/png"), ("JPEG", "image/jpeg")])
def test_data_url_decodes_to_an_rgb_image(fmt, media_type):
    image = load_image_url(data_url(encoded((12, 8), fmt), media_type), MediaPolicy())
    assert image.mode == "RGB" and image.size == (12, 8)
    assert image.getpixel((0, 0))[0] > 150  # the red of the picture, not a blank


def test_transparency_becomes_white_and_grey_becomes_rgb():
    transparent = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    buffer = io.BytesIO()
    transparent.save(buffer, "PNG")
    assert decode_image(buffer.getvalue(), MediaPolicy()).getpixel((1, 1)) == (255, 255, 255)
    assert decode_image(encoded(mode="L"), MediaPolicy()).mode == "RGB"


def test_truncated_image_is_refused():
    data = encoded((64, 64), noise=True)
    refused(data_url(data[: len(data) // 2]), MediaPolicy(), "truncated")


def test_not_an_image_is_refused():
    refused(data_url(b"plain text, not a picture"), MediaPolicy(), "not an image")
    refused("data:text/plain;base64,aGVsbG8=", MediaPolicy(), "data:image/")
    refused("data:image/png;base64,@@not base64@@", MediaPolicy(), "base64")
    refused("ftp://example.com/cat.png", MediaPolicy(), "data:image")


def test_too_many_pixels_is_refused_from_the_header():
    refused(data_url(encoded((100, 60))), MediaPolicy(max_pixels=5000), "6000 pixels", "--max-image-pixels")


def test_pillow_decompression_bomb_is_a_request_error():
    # past twice Pillow's own limit, Image.open itself raises DecompressionBombError: still the request's error
    big = Image.MAX_IMAGE_PIXELS
    side = int((2.5 * big) ** 0.5)
    data = encoded((side, side), mode="L")  # one flat colour: a small file, a huge picture
    refused(data_url(data), MediaPolicy(max_pixels=10 * big), "too many pixels")


def test_data_url_over_the_byte_cap_is_refused():
    refused(data_url(encoded((64, 64), noise=True)), MediaPolicy(max_bytes=1000), "--max-media-bytes")


# --- loading: file:// --------------------------------------------------------------------------------


def test_file_url_inside_the_allowed_folder(media_dir):
    image = load_image_url((media_dir / "cat.png").as_uri(), policy_for(media_dir))
    assert image.size == (16, 16)


def test_file_urls_that_leave_the_folder_are_refused(media_dir):
    policy = policy_for(media_dir)
    refused((media_dir.parent / "secret.png").as_uri(), policy, "outside the allowed media path")
    refused(f"file://{media_dir}/../secret.png", policy, "outside the allowed media path")
    refused((media_dir / "escape.png").as_uri(), policy, "outside the allowed media path")  # a symlink out
    refused((media_dir / "missing.png").as_uri(), policy, "no such file")
    refused(f"file://{media_dir}", policy, "not a file")
    refused("file://otherhost/etc/passwd", policy, "otherhost")


def test_file_urls_are_off_without_an_allowed_folder(media_dir):
    refused((media_dir / "cat.png").as_uri(), MediaPolicy(), "--allowed-local-media-path")


# --- loading: http(s) ---------------------------------------------------------------------------------


def test_http_from_an_allowed_domain(image_host, media_dir):
    assert load_image_url(f"{image_host}/ok.png", policy_for(media_dir)).size == (20, 10)


def test_http_redirect_within_allowed_domains(image_host, media_dir):
    url = f"{image_host}/redirect?to=/ok.png"
    assert load_image_url(url, policy_for(media_dir)).size == (20, 10)


def test_http_from_a_domain_not_allowed(image_host, media_dir):
    localhost = image_host.replace("127.0.0.1", "localhost")
    refused(f"{localhost}/ok.png", policy_for(media_dir), "'localhost' is not an allowed media domain")
    refused(f"{image_host}/ok.png", MediaPolicy(), "http(s) image URLs are off")


def test_http_redirect_to_a_domain_not_allowed(image_host, media_dir):
    target = image_host.replace("127.0.0.1", "localhost") + "/ok.png"
    refused(f"{image_host}/redirect?to={urllib.parse.quote(target)}", policy_for(media_dir),
            "'localhost' is not an allowed media domain")


@pytest.mark.parametrize("path", ["/big", "/drip-big"])
def test_http_over_the_byte_cap(image_host, media_dir, path):
    refused(f"{image_host}{path}", policy_for(media_dir, max_bytes=10_000), "larger than the limit of 10000 bytes")


def test_http_timeout(image_host, media_dir):
    started = time.monotonic()
    refused(f"{image_host}/slow?s=3", policy_for(media_dir, fetch_timeout=0.5), "--media-fetch-timeout")
    assert time.monotonic() - started < 2.5  # gave up at the timeout, not after the host's answer


def test_http_errors_are_refused(image_host, media_dir):
    refused(f"{image_host}/missing", policy_for(media_dir), "HTTP 404")
    refused(f"{image_host}/notimage", policy_for(media_dir), "not an image")


# --- the server ----------------------------------------------------------------------------------------


def chat(*parts: dict, text: str = "What is in the picture?") -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}],
            "max_tokens": 3, "temperature": 0}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


def assert_next_request_works(server: RunningServer) -> None:
    status, body, _ = post(server, CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200, body


def test_image_to_a_text_only_model_is_a_400_naming_it(server):
    status, body, _ = post(server, CHAT, chat(image_part(data_url(encoded()))))
    error = assert_openai_error(body, 400)
    assert "does not take images" in error["message"] and server.model in error["message"]
    assert error["param"] == "messages[0].content"
    assert_next_request_works(server)


def test_input_image_to_a_text_only_model_is_a_400_naming_it(server):
    request = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "describe"},
                                                      {"type": "input_image", "image_url": data_url(encoded())}]}]}
    status, body, _ = post(server, "/v1/responses", request)
    assert status == 400 and "does not take images" in assert_openai_error(body, 400)["message"]
    assert_next_request_works(server)


def test_tokenize_refuses_images(server):
    status, body, _ = post(server, "/tokenize", chat(image_part(data_url(encoded()))))
    assert status == 400 and "image" in assert_openai_error(body, 400)["message"]


# content parts as HF vision templates take them: text, and {"type": "image"} written as the image token
IMAGE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def media_server(engine, media_dir) -> Iterator[RunningServer]:
    """A server on the tiny text model whose image loader is told the model takes images: every refusal of
    the media path shows through HTTP before any image reaches the engine. The fetch timeout outlasts the slow
    image host."""
    settings = ServerSettings(media=policy_for(media_dir, fetch_timeout=2 * SLOW_SECONDS + 2, max_bytes=10_000,
                                              max_pixels=1_000_000), chat_template=IMAGE_TEMPLATE)
    with serve(engine, settings) as running:
        running.app.state.image_loader.takes_images = True
        yield running


def http_refusals(image_host: str, media_dir: Path) -> dict[str, tuple[dict, str, str]]:
    """name -> (request, a word of the message, param)."""
    other_host = image_host.replace("127.0.0.1", "localhost")
    two = chat(image_part(data_url(encoded())), image_part(data_url(encoded())))
    data = encoded((64, 64), noise=True)
    return {
        "truncated": (chat(image_part(data_url(data[:3000]))), "truncated", "messages[0].content[1]"),
        "not an image": (chat(image_part(data_url(b"hello"))), "not an image", "messages[0].content[1]"),
        "too many pixels": (chat(image_part(data_url(encoded((2000, 1000), mode="L")))), "--max-image-pixels",
                            "messages[0].content[1]"),
        "file outside": (chat(image_part(f"file://{media_dir}/../secret.png")), "outside the allowed media path",
                         "messages[0].content[1]"),
        "symlink out": (chat(image_part((media_dir / "escape.png").as_uri())), "outside", "messages[0].content[1]"),
        "domain not allowed": (chat(image_part(f"{other_host}/ok.png")), "not an allowed media domain",
                               "messages[0].content[1]"),
        "over the byte cap": (chat(image_part(f"{image_host}/big")), "--max-media-bytes", "messages[0].content[1]"),
        "too many images": (two, "more than the limit of 1 per prompt", "messages[0].content[2]"),
        "no url": (chat({"type": "image_url", "image_url": {}}), "needs its URL", "messages[0].content[1]"),
        "second message's image": ({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": [
            image_part(data_url(b"bad"))]}], "max_tokens": 2}, "not an image", "messages[1].content[0]"),
    }


@pytest.mark.parametrize("name", ["truncated", "not an image", "too many pixels", "file outside", "symlink out",
                                  "domain not allowed", "over the byte cap", "too many images", "no url",
                                  "second message's image"])
def test_bad_image_is_a_400_naming_it_and_the_next_request_works(media_server, image_host, media_dir, name):
    request, word, param = http_refusals(image_host, media_dir)[name]
    status, body, _ = post(media_server, CHAT, request)
    error = assert_openai_error(body, 400)
    assert status == 400 and word in error["message"] and error["param"] == param, error
    assert_next_request_works(media_server)


def test_responses_input_image_refusals(media_server):
    def respond(part: dict) -> dict:
        status, body, _ = post(media_server, "/v1/responses", {"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "describe"}, part]}], "max_output_tokens": 2})
        assert status == 400
        return assert_openai_error(body, 400)

    error = respond({"type": "input_image", "file_id": "file-123"})
    assert "file_id is not supported" in error["message"] and error["param"] == "input[0].content[1]"
    error = respond({"type": "input_image", "image_url": data_url(b"nope")})
    assert "not an image" in error["message"] and error["param"] == "input[0].content[1]"
    assert_next_request_works(media_server)


def test_a_slow_image_does_not_stall_other_requests(media_server, image_host):
    """The image download runs off the event loop: a text request sent while it waits answers long before it."""
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        slow = pool.submit(post, media_server, CHAT, chat(image_part(f"{image_host}/slow?s={SLOW_SECONDS}")))
        time.sleep(0.2)  # the slow request is waiting on its image
        assert_next_request_works(media_server)
        text_done = time.monotonic() - started
        status, body, _ = slow.result()
        slow_done = time.monotonic() - started
    assert status == 400 and "not an image" in body["error"]["message"]  # it did wait for the host's answer
    assert slow_done >= SLOW_SECONDS
    assert text_done < SLOW_SECONDS, (text_done, slow_done)  # generous: the text request needs a fraction of it


def test_media_flags_become_the_policy(tmp_path):
    from llmplug.entrypoints.cli import build_parser

    parser, _ = build_parser()
    args = parser.parse_args([
        "serve", "--allowed-local-media-path", str(tmp_path), "--allowed-media-domains", "a.com, B.org",
        "--media-fetch-timeout", "2.5", "--max-media-bytes", "1000", "--max-image-pixels", "640000"])
    policy = ServerSettings.from_args(args).media
    assert policy == MediaPolicy(tmp_path.resolve(), frozenset({"a.com", "b.org"}), 2.5, 1000, 640000)
    assert ServerSettings.from_args(parser.parse_args(["serve"])).media == MediaPolicy()


def test_openapi_schema_lists_image_parts(server):
    schema = json.loads(post_get(server, "/openapi.json"))
    assert "ImageURL" in schema["components"]["schemas"]


def post_get(server: RunningServer, path: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(f"{server.base_url}{path}", timeout=10) as response:
        return response.read()


# --- end to end: a tiny LLaVA 1.5 behind the server answers as offline ------------------------------------


LLAVA_KWARGS = {"dtype": "float32", "max_model_len": 256, "block_size": 16, "limit_mm_per_prompt": {"image": 2}}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def png_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return data_url(buffer.getvalue())


def conversation(*names: str, images: dict[str, Image.Image]) -> list[dict]:
    parts = [{"type": "text", "text": "What is in the picture?"}]
    return [{"role": "user", "content": parts + [image_part(png_url(images[name])) for name in names]}]


QUESTIONS = {"gradient": ("gradient",), "shapes": ("shapes",), "both": ("shapes", "gradient")}


@pytest.fixture(scope="module")
def llava_offline(tiny_llava, images) -> dict[str, RequestOutput]:
    """LLM.chat's greedy answers on the tiny LLaVA, per question, made before its server starts (the two engines
    must not step at once)."""
    llm = LLM(str(tiny_llava.path), **LLAVA_KWARGS)
    answers = {name: llm.chat(conversation(*parts, images=images), GREEDY)[0] for name, parts in QUESTIONS.items()}
    del llm
    return answers


@pytest.fixture(scope="module")
def llava_media(tmp_path_factory, images) -> Path:
    """The allowed local media path of the LLaVA server, holding the gradient picture as a PNG."""
    folder = tmp_path_factory.mktemp("llava_media")
    images["gradient"].save(folder / "gradient.png")
    return folder


@pytest.fixture(scope="module")
def llava_server(tiny_llava, llava_offline, llava_media) -> Iterator[RunningServer]:
    engine = AsyncLLM(str(tiny_llava.path), **LLAVA_KWARGS)
    try:
        settings = ServerSettings(media=MediaPolicy(allowed_local_media_path=llava_media.resolve()))
        with serve(engine, settings) as running:
            yield running
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name", sorted(QUESTIONS))
def test_openai_client_image_answers_as_offline(llava_server, llava_offline, images, name):
    reply = llava_server.client().chat.completions.create(
        model=llava_server.model, messages=conversation(*QUESTIONS[name], images=images), temperature=0,
        max_tokens=8, extra_body={"ignore_eos": True})
    expected = llava_offline[name]
    assert reply.choices[0].message.content == expected.outputs[0].text
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)  # the image tokens counted


def test_metrics_count_the_image_tokens_of_the_prompt(llava_server, llava_offline, images):
    """vllm:request_prompt_tokens observes the engine's prompt (placeholders expanded), as usage does."""
    from prometheus_client.parser import text_string_to_metric_families

    def prompt_tokens_sum() -> float:
        text = post_get(llava_server, "/metrics").decode()
        family = next(f for f in text_string_to_metric_families(text) if f.name == "vllm:request_prompt_tokens")
        return next(s.value for s in family.samples if s.name.endswith("_sum"))

    llava_server.wait_idle()
    before = prompt_tokens_sum()
    reply = llava_server.client().chat.completions.create(
        model=llava_server.model, messages=conversation("gradient", images=images), temperature=0, max_tokens=2)
    llava_server.wait_idle()
    assert reply.usage.prompt_tokens == len(llava_offline["gradient"].prompt_token_ids)
    assert prompt_tokens_sum() - before == reply.usage.prompt_tokens


def test_file_url_answers_as_the_same_image_inline(llava_server, llava_offline, llava_media):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"},
                                             image_part((llava_media / "gradient.png").as_uri())]}]
    reply = llava_server.client().chat.completions.create(
        model=llava_server.model, messages=messages, temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == llava_offline["gradient"].outputs[0].text


def test_the_image_reaches_the_model(llava_offline):
    texts = {name: output.outputs[0].text for name, output in llava_offline.items()}
    assert texts["gradient"] != texts["shapes"], texts  # the answer depends on the picture


def test_streamed_image_answer_as_offline(llava_server, llava_offline, images):
    stream = llava_server.client().chat.completions.create(
        model=llava_server.model, messages=conversation("gradient", images=images), temperature=0, max_tokens=8,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == llava_offline["gradient"].outputs[0].text
    assert chunks[-1].usage.prompt_tokens == len(llava_offline["gradient"].prompt_token_ids)


def test_responses_input_image_answers_as_offline(llava_server, llava_offline, images):
    response = llava_server.client().responses.create(
        model=llava_server.model, max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True},
        input=[{"role": "user", "content": [{"type": "input_text", "text": "What is in the picture?"},
                                            {"type": "input_image", "image_url": png_url(images["shapes"])}]}])
    assert response.output_text == llava_offline["shapes"].outputs[0].text
    assert response.usage.input_tokens == len(llava_offline["shapes"].prompt_token_ids)


def greedy_tokens(model, processor, image, chat_text: str) -> list[int]:
    """8 greedy tokens of `model` (transformers, or peft over it) on a rendered chat (its special tokens its own)."""
    inputs = processor_inputs(processor, chat_text, [image], add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_lora_module_on_a_vlm_answers_an_image_as_peft(tiny_llava, images, tmp_path):
    """`--lora-modules` on the tiny LLaVA: a chat with an image_url part naming the adapter as its model answers as
    peft's PeftModel over transformers' LLaVA does on the same chat prompt and image, not as the base model."""
    peft_model = save_adapter(tiny_llava.path, "a", tmp_path / "a", seed=1)
    text = tiny_llava.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"}, {"type": "image"}]}],
        add_generation_prompt=True)
    decode = tiny_llava.processor.tokenizer.decode
    expected = decode(greedy_tokens(peft_model, tiny_llava.processor, images["gradient"], text))
    assert expected != decode(greedy_tokens(tiny_llava.hf_model, tiny_llava.processor, images["gradient"], text))
    engine = AsyncLLM(str(tiny_llava.path), **LLAVA_KWARGS, enable_lora=True, max_lora_rank=8,
                      device={"num_threads": 1})
    try:
        with serve(engine, ServerSettings(lora_modules={"a": str(tmp_path / "a")})) as running:
            reply = running.client().chat.completions.create(
                model="a", messages=conversation("gradient", images=images), temperature=0, max_tokens=8,
                extra_body={"ignore_eos": True})
    finally:
        engine.shutdown()
    assert reply.choices[0].message.content == expected


def test_llava_limit_and_bad_image_then_next_request(llava_server, images):
    three = conversation("shapes", "gradient", "shapes", images=images)
    status, body, _ = post(llava_server, CHAT, {"messages": three, "max_tokens": 2})
    error = assert_openai_error(body, 400)
    assert status == 400 and "more than the limit of 2 per prompt" in error["message"]
    assert error["param"] == "messages[0].content[3]"
    status, body, _ = post(llava_server, CHAT, chat(image_part(data_url(b"GIF89a broken"))))
    assert status == 400 and "messages[0].content[1]" in assert_openai_error(body, 400)["message"]
    status, body, _ = post(llava_server, CHAT, {"messages": conversation("shapes", images=images), "max_tokens": 2})
    assert status == 200, body


def test_llava_max_tokens_past_the_context_with_the_image_tokens(llava_server, llava_offline, images):
    """The image's tokens count against the context: max_tokens that fits the text alone is a 400 naming it."""
    room = LLAVA_KWARGS["max_model_len"] - len(llava_offline["gradient"].prompt_token_ids)
    request = {"messages": conversation("gradient", images=images), "max_tokens": room + 1}
    status, body, _ = post(llava_server, CHAT, request)
    error = assert_openai_error(body, 400)
    assert status == 400 and error["param"] == "max_tokens", error
    status, body, _ = post(llava_server, CHAT, {**request, "max_tokens": room})
    assert status == 200 and body["usage"]["completion_tokens"] <= room, body


def test_beam_search_with_images_is_a_400(llava_server, images):
    request = {"messages": conversation("gradient", images=images), "max_tokens": 2, "use_beam_search": True, "n": 2}
    status, body, _ = post(llava_server, CHAT, request)
    assert status == 400 and assert_openai_error(body, 400)["param"] == "use_beam_search"
