"""The stage graph: derived from what each stage reads and writes, plus explicit `after:`.

A stage that `edits` a slot in place goes after the slot's writer and before every other reader of
it (an `after` edge, so the reader does not wait on data the editor never writes): a plan cannot
put a sink before its output filter, in any order of the YAML.

An edge goes from the writer of a slot to each reader of it (Hamilton/Kedro style). A stage that
`fills` a slot (a cache lookup) comes before that slot's writers, so they can be skipped. The graph
is refused when a read has no writer, two writers of a slot have no order, or there is a cycle.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .findings import Finding
from .messages import suggest
from .registry import Registry

if TYPE_CHECKING:
    import networkx as nx  # imported where a graph is built: `llmplan --help` stays light

    from .stage_spec import BoundStage
    from .yaml_source import Source

DATA, ORDER, FILL = "data", "after", "fill"


def build_graph(stages: list[BoundStage]) -> nx.DiGraph:
    """Nodes are stage ids (with their BoundStage under 'stage'); edges carry the slots they pass."""
    import networkx as nx

    graph = nx.DiGraph()
    writers: dict[str, list[str]] = defaultdict(list)
    fillers: dict[str, list[str]] = defaultdict(list)
    for bound in stages:
        graph.add_node(bound.id, stage=bound)
        for slot in bound.cls.writes:
            writers[slot].append(bound.id)
        for slot in bound.cls.fills:
            fillers[slot].append(bound.id)

    def link(src: str, dst: str, kind: str, slot: str | None = None) -> None:
        if src == dst:
            return
        if not graph.has_edge(src, dst):
            graph.add_edge(src, dst, kinds=set(), slots=set())
        graph.edges[src, dst]["kinds"].add(kind)
        if slot:
            graph.edges[src, dst]["slots"].add(slot)

    editors: dict[str, list[str]] = defaultdict(list)
    for bound in stages:
        for slot in bound.cls.edits:
            editors[slot].append(bound.id)
    for bound in stages:
        for slot in bound.cls.edits:
            for writer in writers.get(slot, []):
                link(writer, bound.id, DATA, slot)
        for slot in (*bound.cls.reads, *bound.cls.optional_reads):
            for editor in editors.get(slot, []):
                if bound.id not in editors[slot] and bound.id not in writers.get(slot, []):
                    link(editor, bound.id, ORDER)
            for writer in writers.get(slot, []):
                link(writer, bound.id, DATA, slot)
            for filler in fillers.get(slot, []):
                if filler != bound.id and bound.id not in writers.get(slot, []):
                    link(filler, bound.id, DATA, slot)
        for slot in bound.cls.fills:
            for writer in writers.get(slot, []):
                link(bound.id, writer, FILL, slot)
        for before in bound.spec.after:
            if before in graph:
                link(before, bound.id, ORDER)
    return graph


def link_findings(stages: list[BoundStage], source: Source, registry: Registry) -> list[Finding]:
    """What the stages refuse before a graph can be built: duplicate ids, `after:` naming no stage (or the stage
    itself), a read no stage writes."""
    findings: list[Finding] = []
    seen: dict[str, int] = {}
    for bound in stages:
        if bound.id in seen:
            findings.append(
                source.finding(
                    ("stages", bound.index, "id"),
                    f"duplicate stage id {bound.id!r} (first used by stages[{seen[bound.id]}])",
                )
            )
        else:
            seen[bound.id] = bound.index
    if findings:
        return findings

    ids = {b.id for b in stages}
    for bound in stages:
        for j, before in enumerate(bound.spec.after):
            if before not in ids:
                findings.append(
                    source.finding(
                        ("stages", bound.index, "after", j), f"no stage with id {before!r}{suggest(before, ids)}"
                    )
                )
            elif before == bound.id:
                findings.append(source.finding(("stages", bound.index, "after", j), "a stage cannot run after itself"))

    writers: dict[str, list[BoundStage]] = defaultdict(list)
    for bound in stages:
        for slot in bound.cls.writes:
            writers[slot].append(bound)
    for bound in stages:
        for slot in (*bound.cls.reads, *bound.cls.edits, *bound.cls.needs(bound.params)):
            if not writers.get(slot):
                makers = sorted(n for n, cls in registry.stages.items() if slot in cls.writes)
                hint = f"; add a stage that writes it ({', '.join(makers)})" if makers else ""
                findings.append(
                    source.finding(
                        ("stages", bound.index, "uses"),
                        f"stage {bound.id!r} reads {slot!r} but no stage in the plan writes it{hint}",
                    )
                )
    return findings


def dag_findings(graph: nx.DiGraph, stages: list[BoundStage], source: Source) -> list[Finding]:
    """What the built graph refuses: a cycle, or two writers of a slot with no order between them."""
    import networkx as nx

    findings: list[Finding] = []
    writers: dict[str, list[BoundStage]] = defaultdict(list)
    for bound in stages:
        for slot in bound.cls.writes:
            writers[slot].append(bound)
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        cycle = None
    if cycle:
        names = [edge[0] for edge in cycle] + [cycle[0][0]]
        first = graph.nodes[cycle[0][0]]["stage"]
        findings.append(source.finding(("stages", first.index, "id"), f"cycle between stages: {' -> '.join(names)}"))
        return findings

    for slot, group in writers.items():
        for i, a in enumerate(group):
            for b in group[i + 1 :]:
                if not (nx.has_path(graph, a.id, b.id) or nx.has_path(graph, b.id, a.id)):
                    findings.append(
                        source.finding(
                            ("stages", b.index, "uses"),
                            f"stages {a.id!r} and {b.id!r} both write {slot!r} with no order between them; "
                            f"add `after: [{a.id}]` to one",
                        )
                    )
    return findings


def execution_order(graph: nx.DiGraph) -> list[str]:
    """Topological order, ties broken by position in the plan (so runs read like the YAML).

    Stages that may fill a slot (a cache lookup), and what they need, go as early as the graph
    allows: a hit must come before the expensive work it makes unnecessary.
    """
    import networkx as nx

    fillers = [n for n in graph if graph.nodes[n]["stage"].cls.fills]
    early = set(fillers).union(*(nx.ancestors(graph, n) for n in fillers)) if fillers else set()
    index = {node: (0 if node in early else 1, graph.nodes[node]["stage"].index) for node in graph}
    return list(nx.lexicographical_topological_sort(graph, key=lambda n: index[n]))


def phase_of(graph: nx.DiGraph, node: str) -> str:
    return str(graph.nodes[node]["stage"].cls.phase)


def to_dot(plan: PlanGraph, labels: dict[str, str] | None = None) -> str:
    graph = plan.dag
    colors = {"load": "#cfe2ff", "compute": "#ffe5b4", "output": "#d1f2d9", "observe": "#eadcf8", "other": "#eeeeee"}
    lines = ["digraph plan {", "  rankdir=LR;", '  node [shape=box, style="rounded,filled", fontname="Helvetica"];']
    for node in plan.order:
        bound = graph.nodes[node]["stage"]
        label = f"{node}\\n{bound.spec.uses}" + (f"\\n{labels[node]}" if labels and node in labels else "")
        lines.append(f'  "{node}" [label="{label}", fillcolor="{colors.get(phase_of(graph, node), "#eee")}"];')
    for src, dst, data in graph.edges(data=True):
        label = ", ".join(sorted(data["slots"]))
        style = "dashed" if data["kinds"] == {ORDER} else ("dotted" if data["kinds"] == {FILL} else "solid")
        lines.append(f'  "{src}" -> "{dst}" [label="{label}", style={style}];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_mermaid(plan: PlanGraph) -> str:
    graph = plan.dag
    lines = ["flowchart LR"]
    safe = {node: f"n{i}" for i, node in enumerate(plan.order)}
    for node, key in safe.items():
        lines.append(f'  {key}["{node}<br/>{graph.nodes[node]["stage"].spec.uses}"]')
    for src, dst, data in graph.edges(data=True):
        label = ", ".join(sorted(data["slots"]))
        arrow = "-.->" if data["kinds"] != {DATA} else "-->"
        lines.append(f"  {safe[src]} {arrow}|{label or 'after'}| {safe[dst]}")
    return "\n".join(lines) + "\n"


# --- the plan's graph as a value -----------------------------------------------------------------------
# A bound plan's stage graph as a value: built once when the plan is bound, its parts values of the same kind.
#
# Learnt from Kedro's pipelines: the whole plan is one `PlanGraph` (the DAG and its execution order); a part
# of it — what `--until` keeps, the resident part and the request part of a served plan, the stages a run
# prepares or cleans up with — is another `PlanGraph` taken from it (`only`, `to_nodes`, `from_nodes`,
# `without`, `where`), never a graph derived again from the stages. A part is a view of the one DAG:
# its edges and the slots they carry are the whole plan's, restricted to the part's stages.


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
