"""Shape profiles: lists of parameter shapes that a benchmark optimizes."""

from __future__ import annotations

from dataclasses import dataclass


def gpt2_small_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """The 148 parameter tensors of GPT-2 small (124,439,808 elements, tied head not repeated)."""
    d, vocab, ctx, layers = 768, 50257, 1024, 12
    shapes = [("wte.weight", (vocab, d)), ("wpe.weight", (ctx, d))]
    for layer in range(layers):
        h = f"h.{layer}."
        shapes += [
            (h + "ln_1.weight", (d,)), (h + "ln_1.bias", (d,)),
            (h + "attn.c_attn.weight", (d, 3 * d)), (h + "attn.c_attn.bias", (3 * d,)),
            (h + "attn.c_proj.weight", (d, d)), (h + "attn.c_proj.bias", (d,)),
            (h + "ln_2.weight", (d,)), (h + "ln_2.bias", (d,)),
            (h + "mlp.c_fc.weight", (d, 4 * d)), (h + "mlp.c_fc.bias", (4 * d,)),
            (h + "mlp.c_proj.weight", (4 * d, d)), (h + "mlp.c_proj.bias", (d,)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def n_tensors(self) -> int:
        return len(self.shapes)

    @property
    def n_elements(self) -> int:
        total = 0
        for _, shape in self.shapes:
            size = 1
            for n in shape:
                size *= n
            total += size
        return total


def _uniform(name: str, count: int, size: int, description: str) -> Profile:
    width = len(str(count - 1))
    return Profile(name, description,
                   tuple((f"p{k:0{width}d}", (size,)) for k in range(count)))


def make_profiles() -> dict[str, Profile]:
    return {p.name: p for p in (
        _uniform("1x64M", 1, 1 << 26, "one 64M-element tensor"),
        _uniform("32x1M", 32, 1 << 20, "32 tensors of 1M"),
        _uniform("64x1M", 64, 1 << 20, "64 tensors of 1M"),
        _uniform("10000x1000", 10_000, 1_000, "10,000 tensors of 1,000"),
        _uniform("1000x100", 1_000, 100, "1,000 tensors of 100"),
        Profile("gpt2", "GPT-2 small parameter shapes (148 tensors, 124M)",
                tuple(gpt2_small_shapes())),
    )}


PROFILES = make_profiles()
# Ordered by tensor count for the plot.
DEFAULT_ORDER = ["1x64M", "64x1M", "gpt2", "1000x100", "10000x1000"]
