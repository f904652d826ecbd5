"""bench's image prompts (rooflib/load/images.py): the generated PNG, the request body, the user's
files, usage errors, a run against a fake chat server that counts an image as the tiny BLIP-2 model
does, and the real CPU vLLM serving that model (profile cpu-tiny-vlm): an image costs the model's
num_query_tokens, read from its config.

Why BLIP-2 (scripts/tiny_model.py): the CPU build of vLLM 0.32.0 cannot import LLaVA, PaliGemma,
Qwen2-VL or Gemma 3 (llava.py, and paligemma.py through vision.py, import pixtral.py, whose
transformers image processor imports torchvision; the others import it themselves), and the set-up
removes torchvision because PyPI's builds do not load with torch 2.13.0+cpu."""
from __future__ import annotations

import base64
import json
import struct
import zlib
from pathlib import Path

import bench
import pytest
from fault_server import Action, as_json, chunks, fault_server, response, sse, word_ids

from rooflib.load import images, runner, workloads
from rooflib.load.asyncclient import Target
from rooflib.serving import engine_setup

# The tiny BLIP-2 model's image: its Q-Former's 32 queries (scripts/tiny_model.py), for the fake server.
TOKENS_PER_IMAGE = 32


def png_header(data: bytes) -> tuple[int, int, int, int]:
    """(width, height, bit depth, colour type) of a PNG, its chunks' CRCs and pixel data checked."""
    assert data[:8] == images.PNG_SIGNATURE
    pos, chunks_seen, idat = 8, [], b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks_seen.append(kind)
        idat += body if kind == b"IDAT" else b""
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        pos += 12 + length
    assert chunks_seen[0] == b"IHDR" and chunks_seen[-1] == b"IEND"
    width, height, depth, colour = header[:4]
    assert len(zlib.decompress(idat)) == height * (1 + 3 * width)  # a filter byte and RGB pixels per row
    return width, height, depth, colour


@pytest.mark.parametrize("size", [(1, 1), (112, 112), (640, 480), (37, 1021)])
def test_the_generated_png_has_the_stated_size(size):
    assert png_header(images.png(*size, "0-0-0")) == (*size, 8, 2)


def test_generated_images_differ_per_request_and_repeat_per_seed():
    assert images.png(64, 64, "0-1-0") == images.png(64, 64, "0-1-0")
    assert len({images.png(64, 64, f"0-{i}-{k}") for i in range(4) for k in range(3)}) == 12


def _target() -> Target:
    return Target("http://127.0.0.1:9", None, "m", {})


def _source(options: images.ImageOptions) -> runner.RequestSource:
    load = workloads.Workload("prompts", 3, 4, 0, entries=[workloads.Entry(prompt=f"text {i}") for i in range(3)])
    return runner.RequestSource(load, _target(), "chat", {}, "run", images=images.source(options, seed=7))


def _body(request: bytes) -> dict:
    return json.loads(request.split(b"\r\n\r\n", 1)[1])


def test_a_chat_request_carries_its_images_before_the_text():
    body = _body(_source(images.read_options("2", "96x64", "")).get(1)[0])
    content = body["messages"][-1]["content"]
    assert [part["type"] for part in content] == ["image_url", "image_url", "text"]
    assert content[-1]["text"] == "text 1" and body["stream_options"]["include_usage"]
    for part in content[:2]:
        mime, data = part["image_url"]["url"].split(",", 1)
        assert mime == "data:image/png;base64"
        assert png_header(base64.b64decode(data))[:2] == (96, 64)


def test_images_zero_is_the_text_only_control():
    body = _body(_source(images.read_options("0", "96x64", "")).get(0)[0])
    assert body["messages"] == [{"role": "user", "content": "text 0"}]


def test_the_users_files_go_with_their_own_type(tmp_path):
    (tmp_path / "a.png").write_bytes(images.png(8, 8, 1))
    (tmp_path / "b.JPG").write_bytes(b"\xff\xd8\xff\xe0 not a full jpeg, sent as it is")
    (tmp_path / "notes.txt").write_text("skipped")
    source = _source(images.read_options("3", "", str(tmp_path)))
    urls = [part["image_url"]["url"] for part in _body(source.get(0)[0])["messages"][-1]["content"][:3]]
    assert [url.split(";")[0] for url in urls] == ["data:image/png", "data:image/jpeg", "data:image/png"]
    (tmp_path / "c.png").write_bytes(b"GIF89a")
    with pytest.raises(images.UsageError, match="c.png is neither a PNG nor a JPEG"):
        _source(images.read_options("1", "", str(tmp_path)))


@pytest.mark.parametrize("argv, message", [
    (["--endpoint", "chat", "--images", "2"], "--images needs --image-size WxH"),
    (["--endpoint", "chat", "--image-size", "448"], "--image-size takes WIDTHxHEIGHT"),
    (["--endpoint", "chat", "--image-size", "0x10"], "sides must be between 1 and 8192"),
    (["--endpoint", "chat", "--images", "-1", "--image-size", "8x8"], "--images must be between 0 and 64"),
    (["--endpoint", "chat", "--image-size", "8x8", "--image-dir", "."], "choose one"),
    (["--image-size", "8x8"], "need --endpoint chat"),
    (["--endpoint", "embeddings", "--image-size", "8x8"], "need --endpoint chat"),
    (["--endpoint", "chat", "--image-dir", "/nonexistent-images"], "not a folder"),
    (["--endpoint", "chat", "--agent-turns", "3", "--image-size", "8x8"], "drop --multi-turn"),
])
def test_image_options_that_do_not_fit_are_one_line_usage_errors(argv, message, capsys):
    with fault_server() as url:
        code = bench.main(["--url", url, "-n", "2", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def _vlm_chat(request) -> Action | None:
    """A chat server that counts as the tiny BLIP-2 model: the text's words (the fake /tokenize's
    count) and TOKENS_PER_IMAGE for each image part, which must be a PNG data URL."""
    if request.path != "/v1/chat/completions":
        return None
    content = request.body["messages"][-1]["content"]
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    try:
        for part in content:
            if part["type"] == "image_url":
                head, data = part["image_url"]["url"].split(",", 1)
                assert head == "data:image/png;base64"
                png_header(base64.b64decode(data))
    except (AssertionError, KeyError, ValueError) as exc:
        return as_json(400, {"error": {"message": f"bad image: {exc!r}"}})
    text = " ".join(part["text"] for part in content if part["type"] == "text")
    prompt = len(word_ids(text)) + TOKENS_PER_IMAGE * sum(part["type"] == "image_url" for part in content)
    count = request.body["max_tokens"]
    events = [{"choices": [{"index": 0, "delta": {"content": " a"}, "finish_reason": "length" if i == count - 1
                            else None}], "usage": {"prompt_tokens": prompt, "completion_tokens": i + 1}}
              for i in range(count)]
    return Action(response(200, chunks(sse(events)), "text/event-stream", chunked=True))


@pytest.mark.parametrize("per_request", [0, 1, 3])
def test_an_image_costs_the_tokens_the_server_counts(per_request, capsys, tmp_path):
    with fault_server(_vlm_chat) as url:
        code = bench.main(["--url", url, "--json", "--timeline-interval", "0", "--endpoint", "chat", "-n", "6",
                           "-c", "2", "--input-tokens", "40", "--output-tokens", "3", "--images", str(per_request),
                           "--image-size", "112x112", "--records", str(tmp_path / "r.jsonl")])
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert code in (0, 4), (result["verdict_reasons"], err)
    assert result["requests"]["completed"] == 6 and result["requests"]["failed"] == 0
    section = result["images"]
    assert (section["per_request"], section["size"], section["text_tokens_mean"]) == (per_request, "112x112", 40)
    assert section["server_prompt_tokens_mean"] == 40 + per_request * TOKENS_PER_IMAGE
    per_image = section["image_tokens_per_image"]
    if per_request:
        assert per_image["min"] == per_image["max"] == TOKENS_PER_IMAGE and per_image["n"] == 6
    else:
        assert per_image["n"] == 0
    assert result["config"]["images"] == {"per_request": per_request, "size": "112x112", "directory": None}
    assert result["workload"]["images"] == result["config"]["images"]
    # The text is the length it was built to; the images are not a mismatch.
    assert result["requests"]["prompt_tokens"]["mismatched"] == 0
    assert not any("not the length they were built to" in w for w in result["warnings"])


def test_the_console_says_what_an_image_costs(capsys):
    with fault_server(_vlm_chat) as url:
        bench.main(["--url", url, "--timeline-interval", "0", "--endpoint", "chat", "-n", "4", "-c", "2",
                    "--input-tokens", "40", "--output-tokens", "3", "--images", "2", "--image-size", "112x112"])
    out = capsys.readouterr().out
    assert f"images: 2 per request (112x112 generated PNG); prompt tokens: text 40.0, server " \
           f"{40 + 2 * TOKENS_PER_IMAGE:.1f}, {TOKENS_PER_IMAGE:.1f} per image" in out


def test_the_ttft_split_adds_up_from_the_servers_means():
    split = images.ttft_split(50.0, {"ttft_ms": {"mean": 40.0}, "queue_ms": {"mean": 5.0},
                                               "prefill_ms": {"mean": 20.0}})
    assert split == {"client_ttft_ms": 50.0, "server_ttft_ms": 40.0, "queue_ms": 5.0, "prefill_ms": 20.0,
                     "rendering_ms": 15.0, "outside_server_ms": 10.0}
    assert images.ttft_split(50.0, None) is None


# ---------------------------------------------------------------------------------------------
# The real CPU vLLM serving the tiny BLIP-2 model (one image per prompt)

def _real(url: str, capsys, *argv: str) -> tuple[int, dict]:
    code = bench.main(["--url", url, "--json", "--timeline-interval", "0", "--endpoint", "chat", "-n", "6", "-c", "2",
                       "--warmup", "1", "--input-tokens", "64", "--output-tokens", "8", *argv])
    out, err = capsys.readouterr()
    assert out.strip(), err
    result = json.loads(out)
    assert code in (0, 4), result["verdict_reasons"]  # 4: this busy machine may stall the client
    assert result["requests"]["completed"] == 6 and result["requests"]["failed"] == 0, result["requests"]["first_errors"]
    return code, result


@pytest.mark.real_vllm
def test_real_vllm_counts_an_image_as_its_config_says(vllm_vlm_server, capsys, tmp_path):
    config = json.loads((engine_setup.model_dir("tiny-blip2") / "config.json").read_text())
    per_image = config["num_query_tokens"]  # vLLM's blip2.py: the queries stand for the image in the prompt
    _, result = _real(vllm_vlm_server.url, capsys, "--images", "1", "--image-size", "448x448")
    section = result["images"]
    assert section["text_tokens_mean"] == 64 and section["server_prompt_tokens_mean"] == 64 + per_image
    assert section["image_tokens_per_image"] == {"mean": per_image, "min": per_image, "max": per_image, "n": 6}
    # Every image (warm-up included) was looked up in the processor cache; each was new.
    assert (section["multimodal_cache"]["queries"], section["multimodal_cache"]["hits"]) == (7, 0)
    split = section["ttft_split"]
    assert split is not None and split["prefill_ms"] > 0 and split["server_ttft_ms"] > 0
    assert result["server"]["metrics"]["prompt_tokens"] == 7 * (64 + per_image)

    # The control: the same texts, no image; the server counts the text alone.
    _, control = _real(vllm_vlm_server.url, capsys, "--images", "0", "--image-size", "448x448")
    assert control["images"]["server_prompt_tokens_mean"] == 64 and control["images"]["multimodal_cache"] is None

    # One file of the user's, sent by every request: the processor cache serves it again.
    (tmp_path / "photo.png").write_bytes(images.png(640, 480, "user"))
    _, mine = _real(vllm_vlm_server.url, capsys, "--image-dir", str(tmp_path))
    cache = mine["images"]["multimodal_cache"]
    assert mine["images"]["image_tokens_per_image"]["min"] == per_image
    assert cache["queries"] == 7 and cache["hits"] >= 1
