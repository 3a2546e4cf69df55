"""How mcore-to-hf cuts the model into load units that bound its memory.

A unit is a list of Megatron tensor names loaded (and then written) together. Each layer is one unit
when it fits ``budget`` bytes; a bigger one (a full-size GLM-5 MoE layer is ~19 GB of 256 experts
against 5 GB output shards) is cut, in its own tensor order, into consecutive slices of at most
``budget`` bytes: the layer's attention and router first, then its experts a few at a time. A tensor
is never cut, so the output shards are written front to back in the same order as before.
"""

from __future__ import annotations


def slice_units(groups: dict[str, list[str]], nbytes: dict[str, int], budget: int) -> list[tuple[str, list[str]]]:
    """``[(label, names)]`` in ``groups`` order; a group above ``budget`` bytes becomes
    ``label[i/n]`` slices of at most ``budget`` bytes each (or one tensor, if that alone is bigger)."""
    if budget < 1:
        raise ValueError(f"slice budget must be positive, got {budget}")
    units: list[tuple[str, list[str]]] = []
    for label, names in groups.items():
        if sum(nbytes[n] for n in names) <= budget:
            units.append((label, list(names)))
            continue
        parts: list[list[str]] = [[]]
        size = 0
        for n in names:
            if parts[-1] and size + nbytes[n] > budget:
                parts.append([])
                size = 0
            parts[-1].append(n)
            size += nbytes[n]
        units += [(f"{label}[{i + 1}/{len(parts)}]", p) for i, p in enumerate(parts)]
    return units
