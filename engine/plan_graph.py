"""A bound plan's stage graph as a value: built once when the plan is bound, its parts values of the same kind.

Learnt from Kedro's pipelines: the whole plan is one `PlanGraph` (the DAG and its execution order); a part
of it — what `--until` keeps, the resident part and the request part of a served plan, the stages a run
prepares or cleans up with — is another `PlanGraph` taken from it (`only`, `to_nodes`, `from_nodes`,
`without`, `where`), never a graph derived again from the stages. A part is a view of the one DAG:
its edges and the slots they carry are the whole plan's, restricted to the part's stages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .graph import FILL, build_graph, execution_order

if TYPE_CHECKING:
    import networkx as nx

    from .plan import BoundStage


class PlanGraph:
    """Stage ids in execution order over their DAG (nodes carry the BoundStage under 'stage')."""

    def __init__(self, dag: nx.DiGraph, order: Sequence[str] | None = None) -> None:
        self.dag = dag
        self.order: tuple[str, ...] = tuple(execution_order(dag) if order is None else order)

    @classmethod
    def build(cls, stages: list[BoundStage]) -> PlanGraph:
        """The whole plan's graph (the plan is known to have no cycle: `bind` checked)."""
        return cls(build_graph(stages))

    # --- reading it -------------------------------------------------------------------------------

    def stage(self, stage_id: str) -> BoundStage:
        """The stage as bound with the plan (a request's own parameters are in its plan, not here)."""
        stage: BoundStage = self.dag.nodes[stage_id]["stage"]
        return stage

    @property
    def nodes(self) -> Any:
        """The DAG's node view (`graph.nodes[id]["stage"]`), as networkx spells it."""
        return self.dag.nodes

    def __iter__(self) -> Iterator[str]:
        return iter(self.order)

    def __contains__(self, stage_id: object) -> bool:
        return stage_id in self.dag

    def __len__(self) -> int:
        return len(self.order)

    def __repr__(self) -> str:
        return f"PlanGraph({list(self.order)})"

    def depends_on(self, stage_id: str) -> set[str]:
        """The stages `stage_id` depends on, less those only joined by fill edges (a cache lookup before a
        stage does not decide what the stage makes)."""
        import networkx as nx

        kept = nx.subgraph_view(self.dag, filter_edge=lambda a, b: self.dag.edges[a, b]["kinds"] != {FILL})
        return set(nx.ancestors(kept, stage_id))

    # --- its parts (each a PlanGraph of this one's stages, in this one's order) ------------------

    def only(self, stage_ids: Iterable[str]) -> PlanGraph:
        """Just these stages (those not in this graph are ignored)."""
        keep = {s for s in stage_ids if s in self.dag}
        return PlanGraph(self.dag.subgraph(keep), [s for s in self.order if s in keep])

    def to_nodes(self, *stage_ids: str) -> PlanGraph:
        """These stages and everything they depend on (`llmplan run --until`)."""
        import networkx as nx

        return self.only(set(stage_ids).union(*(nx.ancestors(self.dag, s) for s in stage_ids)))

    def from_nodes(self, *stage_ids: str) -> PlanGraph:
        """These stages and everything that depends on them (a served plan's request part)."""
        import networkx as nx

        return self.only(set(stage_ids).union(*(nx.descendants(self.dag, s) for s in stage_ids)))

    def without(self, stage_ids: Iterable[str]) -> PlanGraph:
        drop = set(stage_ids)
        return self.only(s for s in self.order if s not in drop)

    def where(self, keep: Callable[[BoundStage], bool]) -> PlanGraph:
        """The stages whose bound stage passes `keep` (e.g. the always-stages)."""
        return self.only(s for s in self.order if keep(self.stage(s)))
