"""What re-quantizing a GGUF file's types to MLX's affine format changes.

For a GGUF file (default: the registry's Gemma 3 270M Q4_K_M), the model loaded
in float32 (every tensor dequantized exactly) is the reference. For each
quantization type the file holds, only that type's tensors are replaced by what
the converter makes of them (``gguf_tensors.convert_tensor``, mode ``affine``,
dequantized back) and the logits on a held-out multilingual text are compared
with the reference: top-1 agreement, mean KL divergence and the median cosine similarity
per position. The last row re-quantizes every type at once (the model as
``--dtype`` none serves it). Prints a markdown table.

    python bench/gguf_agreement.py [--model FILE]
"""

from __future__ import annotations

import argparse

import numpy as np

HELD_OUT = """The harbour master counted the boats twice before the storm arrived, and \
each time the number came out different: forty-one, then forty-three.
def merge(left, right):
    out = []
    while left and right:
        out.append(left.pop(0) if left[0] <= right[0] else right.pop(0))
    return out + left + right
Die Bibliothek öffnet um neun Uhr; die Leser warten schon vor der Tür.
La réunion a été reportée à jeudi, faute de salle disponible.
图书馆九点开门，读者们已经在门口等候。
Библиотека открывается в девять часов.
Q: What is the capital of Australia? A: Canberra. Q: And of Canada? A: Ottawa."""


def logits(model, tokens) -> np.ndarray:
    import mlx.core as mx

    return np.array(model(mx.array([tokens]))[0].astype(mx.float32))


def compare(ref: np.ndarray, got: np.ndarray) -> tuple[float, float, float]:
    top1 = float((ref.argmax(-1) == got.argmax(-1)).mean())

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    p, q = log_softmax(ref.astype(np.float64)), log_softmax(got.astype(np.float64))
    kl = float((np.exp(p) * (p - q)).sum(-1).mean())
    cos = (ref * got).sum(-1) / np.linalg.norm(ref, axis=-1) / np.linalg.norm(got, axis=-1)
    return top1, kl, float(np.median(cos))


def main() -> None:
    import gguf
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_nursery.actors.models import registry
    from mlx_nursery.actors.models.gguf import _hf_name
    from mlx_nursery.actors.models.gguf_tensors import BLOCK_AFFINE, FLOAT, REPACKED, convert_tensor
    from mlx_nursery.actors.models.load import load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: Gemma 3 270M)")
    args = parser.parse_args()
    path = args.model or str(registry.fetch(registry.GEMMA3_270M))
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    kinds: dict[str, list] = {}
    for t in reader.tensors:
        qtype = gguf.GGMLQuantizationType(t.tensor_type).name
        if t.name.endswith(".weight") and qtype not in FLOAT and not t.name.startswith("rope_"):
            kinds.setdefault(qtype, []).append(t)
    model, tokenizer, _ = load_model(path, "float32")
    tokens = tokenizer.encode(HELD_OUT)
    reference = logits(model, tokens)
    exact = dict(tree_flatten(model.parameters()))
    print(f"{path}: {len(tokens)} held-out tokens, float32 reference\n")
    print("| type | tensors | becomes | top-1 agreement | mean KL (nats) | median cosine |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = [*sorted(kinds.items()), ("all", [t for ts in kinds.values() for t in ts])]
    for label, tensors in rows:
        changed, widths = {}, set()
        for t in tensors:
            qtype = gguf.GGMLQuantizationType(t.tensor_type).name
            name = _hf_name(t.name, arch)
            # What the converter makes of the tensor, back in float32.
            c = convert_tensor(t, qtype, "affine")
            if c.bits is None:
                widths.add("float16")
                changed[name] = c.arrays["weight"].astype(mx.float32)
                continue
            how = "re-quantized"
            if qtype in REPACKED or qtype in BLOCK_AFFINE:
                how = "repacked" if qtype in REPACKED else "levels kept"
            widths.add(f"{c.bits}-bit/{c.group_size} {how}")
            changed[name] = mx.dequantize(
                c.arrays["weight"], c.arrays["scales"].astype(mx.float32),
                c.arrays["biases"].astype(mx.float32), group_size=c.group_size, bits=c.bits,
            )  # fmt: skip
        model.update(tree_unflatten(list(changed.items())))
        top1, kl, cos = compare(reference, logits(model, tokens))
        model.update(tree_unflatten([(n, exact[n]) for n in changed]))
        how = "; ".join(sorted(widths)) if label != "all" else "as served"
        print(f"| {label} | {len(tensors)} | {how} | {top1:.1%} | {kl:.4f} | {cos:.5f} |")

if __name__ == "__main__":
    main()
