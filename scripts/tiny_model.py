#!/usr/bin/env python3
"""Build a tiny Hugging Face model locally (no downloads) for a real vLLM to serve on CPU.

Runs under the engine's Python (it needs torch, transformers and tokenizers, which vLLM brings).
The tokenizer is a byte-level BPE (vocab 8192) trained on Python's own standard-library sources,
with a Hermes/Qwen-style chat template that has a tools section, so that
`--tool-call-parser hermes` works. Weights are random with a fixed seed, or trained briefly with
--train-steps (a random model predicts uniformly and cannot tell a right perplexity computation
from a wrong one).

The model always speaks: it never generates a token that decodes to no text (a special token,
which the server skips, or one byte of a multi-byte character), whatever the batching or the
sampling. By construction, not by training: one hidden dimension (`SPEAKER_DIM`) carries the same
value for every input token, no layer writes to it, and the output head reads only that dimension
for the textless tokens, with a large negative weight. The final norm keeps its sign, so their
logits sit at least 90 below the best other token's (measured on random inputs of 1 to 3,000
tokens): greedy decoding never picks them, and sampling at temperature 1 does with odds below
e^-80. (A random model otherwise loops on such tokens, and
streams without text are failures to a load test.) The EOS token is one of them, so every answer
runs to max_tokens.

Architectures (attention kinds vLLM accounts differently in its KV cache):
  qwen3     GQA, 4 layers, 2 KV heads, head_dim 64 (the default, what the tests serve)
  llama     MHA, 3 layers, 4 KV heads, head_dim 64
  gemma3    GQA with sliding-window layers (window 128, every 6th layer global)
  deepseek  DeepSeek-V2 style MLA (kv_lora_rank 64, qk_rope_head_dim 16)
  blip2     a BLIP-2 vision-language model (Blip2ForConditionalGeneration): a vision tower (2 layers,
            hidden 64, 112x112 images in 14x14 patches), a 1-layer Q-Former of 32 queries and a
            projection before the llama text model; its processor (BlipImageProcessor + the
            tokenizer, an `<image>` token) and a chat template that takes OpenAI content parts. Each
            image costs num_query_tokens = 32 prompt tokens, which vLLM inserts at the prompt's start;
            vLLM takes one image per prompt. The projection's output keeps the speaker dimension, so
            the image tokens do not break the always-speaks construction. Chosen because the CPU build
            of vLLM 0.32.0 serves it: LLaVA, PaliGemma, Qwen2-VL and Gemma 3 reach torchvision there
            (llava.py and vision.py import pixtral.py, whose transformers image processor imports it),
            and PyPI's torchvision does not load with torch 2.13.0+cpu, so the set-up removes it.
  bert      a BERT encoder (BertModel, 2 layers, hidden 256, 4,096 positions): a pooling model, no
            KV cache; vLLM serves it with CLS pooling for /v1/embeddings and /score (cosine of two
            embeddings) and /rerank. It generates nothing, so the always-speaks construction does not apply.

Examples:
  tiny_model.py --out ~/.cache/roofline/models/tiny-qwen3
  tiny_model.py --arch llama --out /tmp/tiny-llama
  tiny_model.py --out /tmp/tiny-trained --train-steps 80
  tiny_model.py --arch bert --out ~/.cache/roofline/models/v2/tiny-bert
  tiny_model.py --arch blip2 --out ~/.cache/roofline/models/v2/tiny-blip2

Exit codes: 0 built (or already there), 2 usage error.
"""
from __future__ import annotations

import argparse
import glob
import sys
import sysconfig
from pathlib import Path
from typing import Sequence

VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>"]
SEED = 1234
# The always-speaks construction (see the module's docstring): the dimension, the value every
# input embedding carries there (five times the random init's scale, so it does not drown the
# others after the norm; it reads about 0.45-0.7 after the final norm, whatever the input), and
# the output weight that puts the textless logits about 90-140 below zero.
SPEAKER_DIM = 0
SPEAKER_VALUE = 0.1
SILENCE_WEIGHT = -200.0
# The BLIP-2 model's image: its size, its patch, the queries that stand for it in the prompt, its token.
IMAGE_SIZE = 112
PATCH_SIZE = 14
QUERY_TOKENS = 32
IMAGE_TOKEN = "<image>"

# Hermes/Qwen2.5-style template: the tools section and the <tool_call> JSON convention are what
# vLLM's hermes parser expects.
CHAT_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


# The content of one message, for the BLIP-2 model: a string, or OpenAI content parts, of which the
# template writes the texts (a template that loops over message.content makes vLLM give it the parts,
# its "openai" format); vLLM puts each image's query tokens at the prompt's start itself.
CONTENT = ("{%- if message.content is string %}{{ message.content }}{%- else %}"
           "{%- for part in message.content %}{%- if part.type == 'text' %}{{ part.text }}{%- endif %}"
           "{%- endfor %}{%- endif %}")
VLM_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}",
                                          "{% else %}<|im_start|>{{ message.role }}\n" + CONTENT)
assert VLM_CHAT_TEMPLATE != CHAT_TEMPLATE


def corpus_files(limit: int = 400) -> list[str]:
    """Local text to train on: the standard library's sources, in a stable order."""
    return sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))[:limit]


def build_tokenizer(out: Path, extra_special: Sequence[str] = (), chat_template: str = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[*SPECIAL_TOKENS, *extra_special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(corpus_files(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = chat_template
    fast.save_pretrained(out)
    return fast


def make_config(arch: str, tokenizer):
    import transformers

    # Untied: the output head's rows for textless tokens differ from their input embeddings.
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  max_position_embeddings=8192, tie_word_embeddings=False,
                  eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                  pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    if arch == "qwen3":
        return transformers.Qwen3Config(num_hidden_layers=4, num_key_value_heads=2, head_dim=64, **common)
    if arch == "llama":
        return transformers.LlamaConfig(num_hidden_layers=3, num_key_value_heads=4, head_dim=64, **common)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(num_hidden_layers=6, num_key_value_heads=2, head_dim=64,
                                              sliding_window=128, **common)
    if arch == "bert":  # bidirectional: no KV heads, no EOS (it never generates)
        return transformers.BertConfig(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512,
                                       num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=4096,
                                       pad_token_id=common["pad_token_id"])
    if arch == "deepseek":
        return transformers.DeepseekV2Config(num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=64,
                                             q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32,
                                             # transformers 5 requires experts; first_k_dense_replace=2
                                             # makes both layers dense, so they are never used.
                                             v_head_dim=32, n_routed_experts=4, first_k_dense_replace=2,
                                             topk_method="greedy", **common)
    raise ValueError(arch)


def textless_ids(tokenizer) -> list[int]:
    """Tokens that alone decode to no text: special tokens (a server skips them in its output) and
    pieces of a multi-byte UTF-8 character (a server holds them back until the character ends)."""
    result = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id], skip_special_tokens=True)
        if not text or "\ufffd" in text:
            result.append(token_id)
    return result


def speaker_parameters(model, textless: list[int]) -> list[tuple[object, object]]:
    """(parameter, mask) of each entry the always-speaks construction fixes: the speaker dimension
    of every input embedding, of every layer's writes into the residual stream, of the final norm,
    and the output head's rows (the textless ones wholly, the others at the speaker dimension)."""
    import torch

    fixed = []
    embed = model.get_input_embeddings().weight
    mask = torch.zeros_like(embed, dtype=torch.bool)
    mask[:, SPEAKER_DIM] = True
    fixed.append((embed, mask))
    for name, module in model.named_modules():
        if name.endswith(("o_proj", "down_proj")) and isinstance(module, torch.nn.Linear):
            mask = torch.zeros_like(module.weight, dtype=torch.bool)
            mask[SPEAKER_DIM, :] = True
            fixed.append((module.weight, mask))
    norm = model.model.norm.weight
    mask = torch.zeros_like(norm, dtype=torch.bool)
    mask[SPEAKER_DIM] = True
    fixed.append((norm, mask))
    head = model.get_output_embeddings().weight
    mask = torch.zeros_like(head, dtype=torch.bool)
    mask[:, SPEAKER_DIM] = True
    mask[textless, :] = True
    fixed.append((head, mask))
    return fixed


def make_speaking(model, textless: list[int]) -> None:
    """Set the entries speaker_parameters names (see the module's docstring)."""
    import torch

    with torch.no_grad():
        model.get_input_embeddings().weight[:, SPEAKER_DIM] = SPEAKER_VALUE
        for name, module in model.named_modules():
            if name.endswith(("o_proj", "down_proj")) and isinstance(module, torch.nn.Linear):
                module.weight[SPEAKER_DIM, :] = 0.0
        norm = model.model.norm.weight
        # Gemma's norms scale by (1 + weight): 0 there is 1 elsewhere; both keep the sign.
        norm[SPEAKER_DIM] = 0.0 if float(norm.abs().max()) == 0.0 else 1.0
        head = model.get_output_embeddings().weight
        head[:, SPEAKER_DIM] = 0.0
        head[textless, :] = 0.0
        head[textless, SPEAKER_DIM] = SILENCE_WEIGHT


def train(model, tokenizer, textless: list[int], steps: int, batch: int = 16, seq_len: int = 256) -> float:
    """A few hundred AdamW steps on the same local text: enough to move perplexity off uniform.
    The always-speaks entries keep their values (their gradients are zeroed), and textless
    targets are left out of the loss, so training does not learn to undo the construction."""
    import torch

    ids = []
    for path in corpus_files():
        ids += tokenizer(Path(path).read_text(encoding="utf-8", errors="replace"))["input_ids"]
        if len(ids) > 2_000_000:
            break
    data = torch.tensor(ids)
    for param, mask in speaker_parameters(model, textless):
        param.register_hook(lambda grad, mask=mask: grad.masked_fill(mask, 0.0))
    gen = torch.Generator().manual_seed(SEED)
    # No weight decay: it would shrink the fixed entries, whose gradients are zero.
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    loss = float("nan")
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
        x = torch.stack([data[s:s + seq_len] for s in starts])
        labels = x.masked_fill(torch.isin(x, torch.tensor(textless)), -100)
        loss_t = model(input_ids=x, labels=labels).loss
        optim.zero_grad()
        loss_t.backward()
        optim.step()
        loss = loss_t.item()
        if step % 50 == 0:
            print(f"step {step} loss {loss:.2f}", file=sys.stderr, flush=True)
    model.eval()
    return loss


def build_blip2(out: Path) -> None:
    """The BLIP-2 model (see the module's docstring): a speaking llama text model inside it, the
    processor saved beside it."""
    import torch
    import transformers

    tokenizer = build_tokenizer(out, [IMAGE_TOKEN], VLM_CHAT_TEMPLATE)
    text_config = make_config("llama", tokenizer)
    text_config.architectures = ["LlamaForCausalLM"]
    tower = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2)
    vision = transformers.Blip2VisionConfig(num_hidden_layers=2, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, **tower)
    qformer = transformers.Blip2QFormerConfig(num_hidden_layers=1, encoder_hidden_size=64, vocab_size=VOCAB_SIZE, **tower)
    config = transformers.Blip2Config(vision_config=vision.to_dict(), qformer_config=qformer.to_dict(),
                                      text_config=text_config.to_dict(), num_query_tokens=QUERY_TOKENS,
                                      image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    config.text_config.architectures = ["LlamaForCausalLM"]
    text = transformers.AutoModelForCausalLM.from_config(text_config, dtype=torch.float32)
    make_speaking(text, textless_ids(tokenizer))
    model = transformers.Blip2ForConditionalGeneration(config)
    model.language_model.load_state_dict(text.state_dict())
    with torch.no_grad():  # an image token's embedding carries the speaker value too
        model.language_projection.weight[SPEAKER_DIM, :] = 0.0
        model.language_projection.bias[SPEAKER_DIM] = SPEAKER_VALUE
    model.to(torch.bfloat16).save_pretrained(out)
    images = transformers.BlipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    transformers.Blip2Processor(image_processor=images, tokenizer=tokenizer, num_query_tokens=QUERY_TOKENS,
                                chat_template=VLM_CHAT_TEMPLATE).save_pretrained(out)


def build(out: Path, arch: str, train_steps: int) -> None:
    import torch
    import transformers

    torch.manual_seed(SEED)
    if arch == "blip2":
        build_blip2(out)
        return
    tokenizer = build_tokenizer(out)
    config = make_config(arch, tokenizer)
    if arch == "bert":
        transformers.BertModel(config).to(torch.bfloat16).save_pretrained(out)
        return
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    textless = textless_ids(tokenizer)
    make_speaking(model, textless)
    if train_steps:
        torch.set_num_threads(max(1, torch.get_num_threads()))
        train(model, tokenizer, textless, train_steps)
    model.to(torch.bfloat16).save_pretrained(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder to write the model to")
    p.add_argument("--arch", default="qwen3", choices=["qwen3", "llama", "gemma3", "deepseek", "bert", "blip2"])
    p.add_argument("--train-steps", type=int, default=0, help="AdamW steps on local text (0: random weights)")
    p.add_argument("--force", action="store_true", help="rebuild even if the folder holds a model")
    args = p.parse_args(argv)
    out = Path(args.out).expanduser()
    if (out / "config.json").exists() and (out / "model.safetensors").exists() and not args.force:
        print(f"{out} already holds a model", file=sys.stderr)
        return 0
    if args.train_steps < 0:
        print("error: --train-steps must be >= 0", file=sys.stderr)
        return 2
    if args.train_steps and args.arch in ("bert", "blip2"):
        print(f"error: --train-steps trains a language model: the {args.arch} model is built untrained", file=sys.stderr)
        return 2
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    build(tmp, args.arch, args.train_steps)
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)  # only a complete model ever sits at --out
    print(str(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
