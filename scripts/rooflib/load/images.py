"""Chat prompts with images: a generated image of a stated size (--image-size WxH), or the user's own
files (--image-dir), --images of them in each chat request, as OpenAI `image_url` content parts
with base64 data URLs (no fetch on the server's side); and what the run says of them.

The generated image is a PNG written with the standard library (zlib, struct): smooth colour bands,
different in each request and image (drawn from --seed, the request and the image's index), so
neither the server's multimodal processor cache nor its prefix cache finds one request's image in
another. The files of --image-dir (PNG or JPEG, by their first bytes) go out as they are, in name
order, request i taking images i*N .. i*N+N-1 of the list, round.

What an image costs is the model's count, not ours: the server's usage.prompt_tokens of each
request, minus the text's tokens (the prompt built to --input-tokens by the server's /tokenize,
chat template included), divided by --images. vLLM 0.32 exports no multimodal preprocessing time
(vllm/v1/metrics/loggers.py: the mm cache counters only), so TTFT is split by what it does export
(`ttft_split`): its TTFT starts when rendering starts (vllm/renderers/base.py render_chat_async
takes arrival_time before the chat template, the images' loading and the HF processor), its queue
and prefill times are the engine core's (prefill includes the vision encoder); the rest of its TTFT
is the rendering (preprocessing), inferred; the client's TTFT beyond the server's is the upload and
the API server before rendering, inferred. The control: the same run with --images 0.
"""
from __future__ import annotations

import base64
import random
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rooflib.core.errors import UsageError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
JPEG_START = b"\xff\xd8\xff"
MAX_SIDE = 8192
MAX_PER_REQUEST = 64


@dataclass(frozen=True)
class ImageOptions:
    """--images, --image-size, --image-dir: read once (read_options), checked with the endpoint (check)."""
    per_request: int = 0
    size: tuple[int, int] | None = None  # generated images of this width and height
    directory: str | None = None         # else the user's files

    @property
    def given(self) -> bool:
        return self.size is not None or self.directory is not None

    def recorded(self) -> dict[str, Any] | None:
        """The result's config.images (None when no image option was given)."""
        if not self.given:
            return None
        return {"per_request": self.per_request, "size": None if self.size is None else "%dx%d" % self.size,
                "directory": self.directory}

    def flags(self) -> list[str]:
        """The options as bench's flags again (bench_options.as_flags)."""
        if not self.given:
            return []
        source = ["--image-size", "%dx%d" % self.size] if self.size else ["--image-dir", str(self.directory)]
        return ["--images", str(self.per_request), *source]


def add_args(p) -> None:
    """bench's and sweep's image flags."""
    p.add_argument("--images", default="", help="--endpoint chat: images per request, before the text (default 1 with "
                   "--image-size or --image-dir; 0: the text-only control); an image's tokens are the server's usage "
                   "minus the text's")
    p.add_argument("--image-size", default="", help="a generated PNG of WIDTHxHEIGHT pixels per image, different in "
                   "each request (deterministic by --seed), sent as a data URL")
    p.add_argument("--image-dir", default="", help="your PNG/JPEG images from this folder, in name order, sent as data URLs")


def parse_size(text: str) -> tuple[int, int]:
    """WxH, each side 1..8192 pixels."""
    parts = text.lower().split("x")
    try:
        width, height = (int(part) for part in parts)
    except ValueError:
        raise UsageError(f"--image-size takes WIDTHxHEIGHT in pixels, such as 448x448, got {text!r}")
    if not (1 <= width <= MAX_SIDE and 1 <= height <= MAX_SIDE):
        raise UsageError(f"--image-size sides must be between 1 and {MAX_SIDE} pixels, got {text!r}")
    return width, height


def read_options(images: str, size: str, directory: str) -> ImageOptions:
    """The image flags as given: --images defaults to 1 when --image-size or --image-dir is set."""
    if images in (None, ""):
        count = 1 if size or directory else 0
    else:
        try:
            count = int(images)
        except ValueError:
            raise UsageError(f"--images must be a whole number, got {images!r}")
        if not 0 <= count <= MAX_PER_REQUEST:
            raise UsageError(f"--images must be between 0 and {MAX_PER_REQUEST}, got {images!r}")
    if size and directory:
        raise UsageError("--image-size makes the images and --image-dir gives them: choose one")
    if count and not (size or directory):
        raise UsageError("--images needs --image-size WxH (a generated image) or --image-dir DIR (your images)")
    return ImageOptions(count, parse_size(size) if size else None, directory or None)


def check(options: ImageOptions, endpoint: str, sessions: bool) -> None:
    """A UsageError when images do not fit the run: only chat requests of one turn carry them."""
    if not options.given:
        return
    if endpoint != "chat":
        raise UsageError(f"--images, --image-size and --image-dir need --endpoint chat (images are chat content "
                         f"parts), not {endpoint}")
    if sessions:
        raise UsageError("--images attaches images to single chat requests: drop --multi-turn, --agent-turns "
                         "and --sessions")
    if options.directory:
        image_files(options.directory)


def image_files(directory: str) -> list[Path]:
    """The PNG and JPEG files of --image-dir, in name order."""
    folder = Path(directory).expanduser()
    if not folder.is_dir():
        raise UsageError(f"--image-dir {directory}: not a folder")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    if not files:
        raise UsageError(f"--image-dir {directory}: no .png, .jpg or .jpeg file in it")
    return files


def mime_type(data: bytes, name: str) -> str:
    """image/png or image/jpeg, by the file's first bytes (not its name)."""
    if data.startswith(PNG_SIGNATURE):
        return "image/png"
    if data.startswith(JPEG_START):
        return "image/jpeg"
    raise UsageError(f"--image-dir: {name} is neither a PNG nor a JPEG file (by its first bytes)")


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png(width: int, height: int, seed: str | int) -> bytes:
    """An RGB PNG of width x height: diagonal colour bands drawn from `seed`, the same for the same seed.
    Each row is a slice of one band pattern, shifted per row, so a large image is made in milliseconds."""
    rng = random.Random(seed)
    tilt, shift, start = rng.randrange(1, 8), rng.randrange(1, 256), rng.randrange(256)
    band = bytes((start + tilt * i) & 0xFF for i in range(3 * width + 256))
    raw = b"".join(b"\x00" + band[(y * shift) % 256:(y * shift) % 256 + 3 * width] for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB, no interlace
    return PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 6)) + _chunk(b"IEND", b"")


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def part(url: str) -> dict[str, Any]:
    """One OpenAI chat content part carrying an image."""
    return {"type": "image_url", "image_url": {"url": url}}


@dataclass(frozen=True)
class ImageSource:
    """The images of each request, made when the request is (picklable: --workers sends it along)."""
    per_request: int
    size: tuple[int, int] | None
    seed: int
    files: tuple[str, ...] = ()  # the data URLs of --image-dir's files

    def parts(self, index: int) -> list[dict[str, Any]]:
        if self.size is not None:
            return [part(data_url("image/png", png(*self.size, f"{self.seed}-{index}-{k}")))
                    for k in range(self.per_request)]
        return [part(self.files[(index * self.per_request + k) % len(self.files)]) for k in range(self.per_request)]


def source(options: ImageOptions, seed: int) -> ImageSource | None:
    """The run's images (None: a text-only run, --images 0 included); the files are read once, here."""
    if not options.per_request:
        return None
    files: tuple[str, ...] = ()
    if options.directory:
        contents = [(p.name, p.read_bytes()) for p in image_files(options.directory)]
        files = tuple(data_url(mime_type(data, name), data) for name, data in contents)
    return ImageSource(options.per_request, options.size, seed, files)


def with_images(body: dict[str, Any], parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The chat body with the images before the last message's text, as content parts."""
    messages = list(body["messages"])
    text = messages[-1]["content"]
    messages[-1] = {**messages[-1], "content": [*parts, {"type": "text", "text": text}]}
    return {**body, "messages": messages}


def section(options: ImageOptions, outcomes: Sequence[Any], metrics: dict[str, Any] | None) -> dict[str, Any] | None:
    """The result's `images`: the text's and the server's prompt tokens, an image's tokens (their
    difference per image, by the server's usage), the multimodal cache, and the TTFT split (against
    the client's mean TTFT over the same requests as the server's histograms: warm-up included)."""
    if not options.given:
        return None
    done = [o for o in outcomes if o.ok and not o.warmup and o.prompt_tokens is not None
            and o.prompt_target is not None]
    per_image = [(o.prompt_tokens - o.prompt_target) / options.per_request for o in done] \
        if options.per_request else []
    return {
        **(options.recorded() or {}),
        "text_tokens_mean": _mean([o.prompt_target for o in done]),
        "server_prompt_tokens_mean": _mean([o.prompt_tokens for o in done]),
        "image_tokens_per_image": {"mean": _mean(per_image), "min": min(per_image, default=None),
                                   "max": max(per_image, default=None), "n": len(per_image)},
        "multimodal_cache": (metrics or {}).get("multimodal_cache"),
        "ttft_split": ttft_split(_mean([o.ttft_ms for o in outcomes if o.ok and o.token_times]), metrics),
    }


def ttft_split(client: float | None, metrics: dict[str, Any] | None) -> dict[str, Any] | None:
    """Mean TTFT in parts, in ms: what the server measured (its TTFT, queue, prefill) and what is inferred
    from them (rendering = preprocessing; outside = the client's TTFT beyond the server's)."""
    def mean(name: str) -> float | None:
        return ((metrics or {}).get(name) or {}).get("mean")
    server, queue, prefill = mean("ttft_ms"), mean("queue_ms"), mean("prefill_ms")
    if server is None or queue is None or prefill is None:
        return None
    return {"client_ttft_ms": client, "server_ttft_ms": server, "queue_ms": queue, "prefill_ms": prefill,
            "rendering_ms": server - queue - prefill,
            "outside_server_ms": None if client is None else client - server}


def summary(section_: dict[str, Any] | None) -> list[str]:
    """The console's lines about the images (none for a run without image options)."""
    if not section_:
        return []
    source = f"{section_['size']} generated PNG" if section_["size"] else f"files of {section_['directory']}"
    per_image = section_["image_tokens_per_image"]
    lines = [f"images: {section_['per_request']} per request ({source}); prompt tokens: text "
             f"{_fmt(section_['text_tokens_mean'])}, server {_fmt(section_['server_prompt_tokens_mean'])}"
             + (f", {_fmt(per_image['mean'])} per image" if per_image["n"] else "")]
    split = section_["ttft_split"]
    if split:
        lines.append(f"TTFT mean {_fmt(split['client_ttft_ms'])} ms = outside the server "
                     f"{_fmt(split['outside_server_ms'])} + rendering (preprocessing) {_fmt(split['rendering_ms'])}"
                     f" + queue {_fmt(split['queue_ms'])} + prefill (vision encoder included) "
                     f"{_fmt(split['prefill_ms'])} ms")
    cache = section_["multimodal_cache"]
    if cache:
        lines.append(f"multimodal cache: {cache['hits']} hits of {cache['queries']} images looked up")
    return lines


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.1f}"
