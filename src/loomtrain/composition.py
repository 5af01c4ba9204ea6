"""Which components run together: the one table assembled from their `refuses`, checked at
config time (train/config.py) and rendered to docs/composition.md (tools/render_composition.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from loomtrain.component import Component, Refusal


@dataclass
class Composition:
    """The table of which components run together, assembled from their `refuses`: for each
    unordered pair, the refusal (from either side) or None."""

    components: tuple[type[Component], ...]
    cells: dict[tuple[str, str], tuple[str, Refusal]] = field(default_factory=dict)

    @classmethod
    def of(cls, components) -> "Composition":
        table = cls(tuple(components))
        names = {c.name for c in components}
        for c in components:
            for other, refusal in c.refuses.items():
                if other not in names:
                    raise AssertionError(f"component {c.name!r} refuses unknown {other!r}")
                pair = tuple(sorted((c.name, other)))
                if pair in table.cells:
                    raise AssertionError(f"{pair} is refused twice: keep one side's refusal")
                table.cells[pair] = (c.name, refusal)
        return table

    def refusal(self, a: str, b: str) -> tuple[str, Refusal] | None:
        return self.cells.get(tuple(sorted((a, b))))

    def check(self, cfg) -> None:
        """Raise ValueError for the first refused pair of active components (in the order
        of the component list)."""
        active = [c for c in self.components if c.switches and c.active(cfg)]
        by_name = {c.name: c for c in active}
        for c in active:
            for other, refusal in c.refuses.items():
                if other in by_name and (refusal.when is None or refusal.when(cfg)):
                    raise ValueError(refusal_message(cfg, c, by_name[other], refusal))

    def markdown(self) -> str:
        """The table as Markdown: one row per component with a switch, and its refusals."""
        switched = [c for c in self.components if c.switches]
        lines = ["| component | switched on by | does not run with |", "|---|---|---|"]
        for c in switched:
            refused = []
            for other in switched:
                cell = self.refusal(c.name, other.name) if other is not c else None
                if cell is None:
                    continue
                _, r = cell
                label = other.name + (f" ({r.partly})" if r.partly else "")
                refused.append(label + ("" if r.yet else " (by design)"))
            keys = ", ".join(f"`{s.key}`" for s in c.switches)
            lines.append(f"| {c.name} | {keys} | {', '.join(refused) or 'runs with all'} |")
        lines += ["", "Why, for each refused pair:", ""]
        for (a, b), (owner, r) in sorted(self.cells.items()):
            lines.append(f"- **{a} x {b}**{f' ({r.partly})' if r.partly else ''}"
                         f"{'' if r.yet else ' (by design)'}: {r.reason}")
        return "\n".join(lines) + "\n"


def refusal_message(cfg, component: type[Component], other: type[Component],
                    refusal: Refusal) -> str:
    """'A=x with B=y is not supported[ yet]: reason (B=allowed)'."""
    off = other.switch(cfg)
    return (f"{component.switch(cfg).named(cfg)} with {off.named(cfg)} is not supported"
            f"{' yet' if refusal.yet else ''}: {refusal.reason} ({refusal.allowed or off.allowed()})")
