"""Block extrapolation: the IR of an N-block model from the captures of the same model at a and a+1 blocks.

Capturing a deep model costs torch.compile time in proportion to its depth (about 2.5 s per Llama-3-8B block
on two CPU cores), while its post-grad graphs are regular: adding one block inserts one period into a few
periodic runs of nodes (the parameter placeholders, the block's forward or backward, the saved activations)
and one period into the output node's list. This module finds those runs by aligning the two captures and
writes the N-block graphs, node for node, without tracing them.

Nothing is guessed: every number that changes with depth (an FX name's counter, a layer index in a module
path, which copy of a run an input refers to) must be affine in the depth L and the copy index k, and the
fit is checked against every node of both captures. Anything the alignment cannot explain (a node whose
input count grows, a run too short to have an interior copy, a counter that is not affine) raises
NotExtrapolable and the caller captures all N blocks instead. tests/test_extrapolate.py checks the result
against full captures (identical graphs) at several depths.

Pure Python over IR documents (dicts, docs/ir.md); no torch.
"""
from __future__ import annotations

import copy
import difflib
import json
import re

from .errors import CeOverlapError


class NotExtrapolable(CeOverlapError):
    """The two captures are not related by inserted periods; capture every block instead."""


class NeedsDeeperCaptures(NotExtrapolable):
    """A growing run has no interior copy at these depths; captures one block deeper may extrapolate."""


_NAME = re.compile(r"^(.*?)(?:_(\d+))?$")
_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


def _split_name(name: str) -> tuple[str, int]:
    """FX names: "mm" is counter 0 of base "mm", "mm_7" counter 7."""
    m = _NAME.match(name)
    base, counter = m.group(1), int(m.group(2) or 0)
    if _join_name(base, counter) != name or not base:
        return name, 0  # not of the FX form ("x_0", "_3"): constant, must then not change with depth
    return base, counter


def _join_name(base: str, counter: int) -> str:
    return base if counter == 0 else f"{base}_{counter}"


def _split_path(path: str) -> tuple[str, list[int]]:
    """"layers.12.attention" -> ("layers.#.attention", [12])."""
    numbers = [int(m.group()) for m in _NUMBER.finditer(path)]
    return _NUMBER.sub("#", path), numbers


def _join_path(template: str, numbers: list[int]) -> str:
    it = iter(numbers)
    return re.sub("#", lambda _: str(next(it)), template)


# ----------------------------------------------------------------------------------------------------------------
# Sequences: align X (depth a) with Y (depth a+1), find the periodic runs that grew

class _Layout:
    """Coordinates of the items of Y and X: ("c", j) for an item present once at every depth, ("r", run, k, i)
    for slot i of copy k of a periodic run. Runs grow by one copy from X to Y."""

    def __init__(self, x_sigs: list, y_sigs: list, what: str):
        inserted = self._inserted(x_sigs, y_sigs, what)
        self.runs: list[tuple[int, int, int]] = []  # (start in Y, period, copies in Y)
        chunk_starts = sorted(inserted)
        for s in chunk_starts:
            e = inserted[s]
            p = e - s
            r = s
            while r - p >= 0 and all(y_sigs[r - p + t] == y_sigs[r + t] for t in range(p)) and \
                    not any(r - p <= q < r for q in chunk_starts if q != s):
                r -= p
            copies = (e - r) // p
            if self.runs and r < self.runs[-1][0] + self.runs[-1][1] * self.runs[-1][2]:
                raise NotExtrapolable(f"{what}: two growing runs overlap at item {r}")
            self.runs.append((r, p, copies))
        self.y_coord: list[tuple] = []
        run_at = {r: n for n, (r, _, _) in enumerate(self.runs)}
        j = 0
        const = 0
        while j < len(y_sigs):
            if j in run_at:
                n = run_at[j]
                _, p, copies = self.runs[n]
                self.y_coord += [("r", n, k, i) for k in range(copies) for i in range(p)]
                j += p * copies
            else:
                self.y_coord.append(("c", const))
                const += 1
                j += 1
        self._y_pos = {c: j for j, c in enumerate(self.y_coord)}
        # X = Y without the last copy of every run (the inserted chunk, right-normalized).
        self.x_coord = [c for c in self.y_coord if not (c[0] == "r" and c[2] == self.runs[c[1]][2] - 1)]
        if [y_sigs[self.y_index(c)] for c in self.x_coord] != list(x_sigs):
            raise NotExtrapolable(f"{what}: the alignment does not reproduce the shallower capture")
        for r, p, copies in self.runs:
            if copies < 3:
                raise NeedsDeeperCaptures(f"{what}: the run at item {r} has {copies} copies; extrapolating needs "
                                          "an interior one (capture one block deeper)")

    @staticmethod
    def _inserted(x_sigs: list, y_sigs: list, what: str) -> dict[int, int]:
        """{start: end} of the chunks of Y that X lacks, each slid as far right as it goes (canonical)."""
        ops = difflib.SequenceMatcher(None, x_sigs, y_sigs, autojunk=False).get_opcodes()
        bad = [op for op in ops if op[0] not in ("equal", "insert")]
        if bad:
            tag, i1, i2, j1, j2 = bad[0]
            raise NotExtrapolable(f"{what}: items {i1}..{i2} of the shallower capture {tag}d, not only inserted "
                                  "(something grows that is not a run of repeated items)")
        mark = [False] * len(y_sigs)
        for tag, _, _, j1, j2 in ops:
            if tag == "insert":
                for j in range(j1, j2):
                    mark[j] = True
        chunks = {}
        j = 0
        while j < len(mark):
            if not mark[j]:
                j += 1
                continue
            s = j
            while j < len(mark) and mark[j]:
                j += 1
            e = j
            while e < len(mark) and not mark[e] and y_sigs[s] == y_sigs[e]:  # slide right
                mark[s], mark[e] = False, True
                s, e = s + 1, e + 1
            while e < len(mark) and mark[e]:  # slid into the next chunk: merge
                e += 1
            chunks[s] = e
            j = e
        return chunks

    def y_index(self, coord: tuple) -> int:
        return self._y_pos[coord]

    def copies(self, run: int, depth_delta: int) -> int:
        """Copies of `run` at depth a+1+depth_delta."""
        return self.runs[run][2] + depth_delta

    def target_coords(self, depth_delta: int) -> list[tuple]:
        """Coordinates of the items at depth a+1+depth_delta, in order."""
        out = []
        done = set()
        for c in self.y_coord:
            if c[0] == "c":
                out.append(c)
            elif c[1] not in done:
                done.add(c[1])
                _, p, _ = self.runs[c[1]]
                out += [("r", c[1], k, i) for k in range(self.copies(c[1], depth_delta)) for i in range(p)]
        return out


def _role_copy(k: int, copies_target: int, copies_y: int) -> int:
    """Which copy of Y stands for copy k at the target depth: the first and last copies for themselves, an
    interior copy (the last interior one in Y) for every other."""
    if k == 0:
        return 0
    if k == copies_target - 1:
        return copies_y - 1
    return min(k, copies_y - 2)


class _Affine:
    """Fits integer quantities as q = q_Y(source) + w * (L - L_Y) + v * (k - k_source) per slot, from X and Y,
    and refuses any slot whose observations do not all satisfy the fit."""

    def __init__(self, layout: _Layout, what: str):
        self.layout = layout
        self.what = what

    def fit(self, key: tuple, y_obs: dict, x_obs: dict, label: str) -> tuple[int, int]:
        """y_obs/x_obs: {copy k (None for constants): value}. Returns (w, v)."""
        if None in y_obs:  # a constant item: one value per depth
            w = y_obs[None] - x_obs[None]
            return w, 0
        ks = sorted(y_obs)
        if len(ks) < 2:
            raise NotExtrapolable(f"{self.what}: {label} of {key} seen in one copy only")
        v = y_obs[ks[-1]] - y_obs[ks[-2]]
        common = [k for k in ks if k in x_obs]
        if not common:
            raise NotExtrapolable(f"{self.what}: {label} of {key} not seen at both depths")
        w = y_obs[common[-1]] - x_obs[common[-1]]
        for k in ks:
            if y_obs[k] != y_obs[ks[-1]] + v * (k - ks[-1]):
                raise NotExtrapolable(f"{self.what}: {label} of {key} is not affine in the copy index "
                                      f"(copy {k}: {y_obs[k]})")
        for k in common:
            if x_obs[k] != y_obs[k] - w:
                raise NotExtrapolable(f"{self.what}: {label} of {key} is not affine in the depth (copy {k})")
        return w, v


# ----------------------------------------------------------------------------------------------------------------
# Graphs

def _node_sig(node: dict) -> str:
    stack = [[_split_path(p)[0], t] for p, t in node["module_stack"]]
    return json.dumps([node["kind"], node["op"], node["outputs"], node["flops"], node["bytes_accessed"], stack,
                       _split_name(node["name"])[0], len(node["inputs"]), node.get("collective")],
                      sort_keys=True)


class _GraphExtrapolation:
    def __init__(self, gx: dict, gy: dict):
        self.name = gy["name"]
        what = f"graph {self.name!r}"
        self.what = what
        xs, ys = gx["nodes"], gy["nodes"]
        if not xs or not ys or xs[-1]["op"] != "output" or ys[-1]["op"] != "output":
            raise NotExtrapolable(f"{what}: the last node is not the output")
        self.xs, self.ys = xs[:-1], ys[:-1]
        self.x_out, self.y_out = xs[-1], ys[-1]
        self.nodes = _Layout([_node_sig(n) for n in self.xs], [_node_sig(n) for n in self.ys], what)
        self.aff = _Affine(self.nodes, what)
        self.x_node = {c: self.xs[j] for j, c in enumerate(self.nodes.x_coord)}
        self.y_node = {c: self.ys[j] for j, c in enumerate(self.nodes.y_coord)}
        self.x_of_id = {j: c for j, c in enumerate(self.nodes.x_coord)}
        self.y_of_id = {j: c for j, c in enumerate(self.nodes.y_coord)}
        self._fit_nodes()
        self._fit_output()

    # -- per-slot fits ---------------------------------------------------------------------------------------------
    @staticmethod
    def _slot(c: tuple) -> tuple:
        return ("c", c[1]) if c[0] == "c" else ("r", c[1], c[3])

    def _observations(self, coords_nodes: dict, fn) -> dict:
        """{slot: {copy or None: value}} over one capture."""
        out: dict = {}
        for c, node in coords_nodes.items():
            out.setdefault(self._slot(c), {})[None if c[0] == "c" else c[2]] = fn(c, node)
        return out

    def _fit_nodes(self):
        what = self.what
        # names: base fixed per slot, counter affine
        y_names = self._observations(self.y_node, lambda c, n: _split_name(n["name"]))
        x_names = self._observations(self.x_node, lambda c, n: _split_name(n["name"]))
        self.name_fit = {}
        for slot, obs in y_names.items():
            bases = {b for b, _ in obs.values()} | {b for b, _ in x_names[slot].values()}
            if len(bases) != 1:
                raise NotExtrapolable(f"{what}: node names of {slot} differ in more than a counter: {sorted(bases)}")
            w, v = self.aff.fit(slot, {k: n for k, (_, n) in obs.items()},
                                {k: n for k, (_, n) in x_names[slot].items()}, "the name counter")
            self.name_fit[slot] = (bases.pop(), w, v)
        # module path numbers
        self.path_fit = {}
        y_paths = self._observations(self.y_node, lambda c, n: [_split_path(p)[1] for p, _ in n["module_stack"]])
        x_paths = self._observations(self.x_node, lambda c, n: [_split_path(p)[1] for p, _ in n["module_stack"]])
        for slot, obs in y_paths.items():
            any_copy = next(iter(obs.values()))
            fits = []
            for e, nums in enumerate(any_copy):
                fits.append([self.aff.fit(slot, {k: v[e][q] for k, v in obs.items()},
                                          {k: v[e][q] for k, v in x_paths[slot].items()},
                                          f"module path number {q} of stack entry {e}")
                             for q in range(len(nums))])
            self.path_fit[slot] = fits
        # inputs: what each input slot refers to, per copy role, and the referenced copy affine
        self.input_fit = {}
        y_refs = self._observations(self.y_node, lambda c, n: [self.y_of_id[i] for i in n["inputs"]])
        x_refs = self._observations(self.x_node, lambda c, n: [self.x_of_id[i] for i in n["inputs"]])
        for slot, obs in y_refs.items():
            self.input_fit[slot] = self._fit_refs(slot, obs, x_refs[slot], "input")

    def _fit_refs(self, slot, y_obs: dict, x_obs: dict, label: str) -> list:
        """Per position of the reference list: {role copy of Y (None: constant item): (target slot, w, v)}.
        Copies whose reference targets a different slot than their neighbours (the first block reading the
        embedding instead of the previous block) are kept apart by role."""
        n = len(next(iter(y_obs.values())))
        last_y = max((k for k in y_obs if k is not None), default=None)
        fits = []
        for pos in range(n):
            by_target: dict = {}
            for k, refs in y_obs.items():
                by_target.setdefault(self._slot(refs[pos]), ({}, {}))[0][k] = refs[pos]
            for k, refs in x_obs.items():
                by_target.setdefault(self._slot(refs[pos]), ({}, {}))[1][k] = refs[pos]
            if len(by_target) > 1:  # only the first and last copies may read something else than the rest
                last_x = max((k for k in x_obs if k is not None), default=None)
                interior = set(y_obs) - {0, last_y}
                for target, (ys, xs) in by_target.items():
                    if set(ys) & interior and set(ys) >= interior:
                        continue  # the interior copies' pattern
                    if not (set(ys) <= {0, last_y} and set(xs) <= {0, last_x}):
                        raise NotExtrapolable(f"{self.what}: {label} {pos} of {slot} refers to {target} in copies "
                                              f"{sorted(ys)}: interior copies differ")
            per_copy = {}
            for target, (ys, xs) in by_target.items():
                if target[0] == "c":
                    fit = (target, 0, 0)
                else:
                    if len(ys) == 1 and None not in ys:  # a boundary copy: fixed pattern, compared by role
                        (k, ref), = ys.items()
                        x_ref = xs.get(k - 1 if k == last_y and k > 0 else k)
                        w = 0 if x_ref is None else ref[2] - x_ref[2]
                        fit = (target, w, 0, ref[2], k)
                        for kk in ys:
                            per_copy[kk] = fit
                        continue
                    w, v = self.aff.fit((slot, label, pos), {k: r[2] for k, r in ys.items()},
                                        {k: r[2] for k, r in xs.items()}, f"the copy {label} {pos} refers to")
                    ky = max(ys)
                    fit = (target, w, v, ys[ky][2], ky)
                for k in ys:
                    per_copy[k] = fit
            fits.append(per_copy)
        return fits

    def _fit_output(self):
        """The output node's input list: itself a sequence with runs (saved activations, gradients)."""
        what = f"{self.what} output"
        x_refs = [self.x_of_id[i] for i in self.x_out["inputs"]]
        y_refs = [self.y_of_id[i] for i in self.y_out["inputs"]]
        sig = lambda c: repr(self._slot(c))
        self.out_layout = _Layout([sig(c) for c in x_refs], [sig(c) for c in y_refs], what)
        y_obs, x_obs = {}, {}
        for c, ref in zip(self.out_layout.y_coord, y_refs):
            y_obs.setdefault(self._slot(c), {})[None if c[0] == "c" else c[2]] = [ref]
        for c, ref in zip(self.out_layout.x_coord, x_refs):
            x_obs.setdefault(self._slot(c), {})[None if c[0] == "c" else c[2]] = [ref]
        self.out_fit = {slot: self._fit_refs(("output", slot), obs, x_obs.get(slot, {}), "output entry")[0]
                        for slot, obs in y_obs.items()}

    # -- writing the deeper graph ---------------------------------------------------------------------------------
    def build(self, depth_delta: int) -> dict:
        lay = self.nodes
        coords = lay.target_coords(depth_delta)
        pos = {c: j for j, c in enumerate(coords)}

        def value(w_v, y_value, k, k_src):
            w, v = w_v
            return y_value + w * depth_delta + v * ((k or 0) - (k_src or 0))

        def resolve(fit, k, k_src):
            target = fit[0]
            if target[0] == "c":
                return pos[("c", target[1])]
            _, w, v, ref_copy, ky = fit
            copies = lay.copies(target[1], depth_delta)
            kk = ref_copy + w * depth_delta + v * ((k or 0) - (ky or 0))
            if not 0 <= kk < copies:
                raise NotExtrapolable(f"{self.what}: a reference falls outside its run (copy {kk} of {copies})")
            return pos[("r", target[1], kk, target[2])]

        out_nodes = []
        for j, c in enumerate(coords):
            if c[0] == "c":
                src_c, k, k_src = c, None, None
            else:
                k_src = _role_copy(c[2], lay.copies(c[1], depth_delta), lay.copies(c[1], 0))
                src_c, k = ("r", c[1], k_src, c[3]), c[2]
            src = self.y_node[src_c]
            slot = self._slot(c)
            base, w, v = self.name_fit[slot]
            _, y_counter = _split_name(src["name"])
            node = copy.deepcopy(src)
            node["id"] = j
            node["name"] = _join_name(base, value((w, v), y_counter, k, k_src))
            stack = []
            for (path, typ), fits in zip(src["module_stack"], self.path_fit[slot]):
                template, numbers = _split_path(path)
                stack.append([_join_path(template, [value(f, n, k, k_src) for f, n in zip(fits, numbers)]), typ])
            node["module_stack"] = stack
            node["inputs"] = [resolve(self._pick(fits, k_src, c), k, k_src) for fits in self.input_fit[slot]]
            node["block"] = -1
            out_nodes.append(node)
        out = copy.deepcopy(self.y_out)
        out["id"] = len(out_nodes)
        out["block"] = -1
        refs = []
        ol = self.out_layout
        for c in ol.target_coords(depth_delta):
            if c[0] == "c":
                fit, k, k_src = self.out_fit[("c", c[1])][None], None, None
            else:
                k_src = _role_copy(c[2], ol.copies(c[1], depth_delta), ol.copies(c[1], 0))
                fit, k = self._pick(self.out_fit[("r", c[1], c[3])], k_src, c), c[2]
            refs.append(resolve(fit, k, k_src))
        out["inputs"] = refs
        out_nodes.append(out)
        names = [n["name"] for n in out_nodes]
        if len(set(names)) != len(names):
            raise NotExtrapolable(f"{self.what}: extrapolated node names collide")
        return {"name": self.name, "nodes": out_nodes}

    def _pick(self, per_copy: dict, k_src, c):
        if k_src in per_copy:
            return per_copy[k_src]
        raise NotExtrapolable(f"{self.what}: no reference pattern for copy {k_src} of {c}")


def extrapolate(doc_x: dict, doc_y: dict, depth_x: int, depth: int) -> dict:
    """The IR document at `depth` blocks from IR documents captured at depth_x and depth_x + 1 blocks
    (documents as capture_ir returns them: same model, options and world size). Raises NotExtrapolable."""
    if depth <= depth_x + 1:
        raise ValueError(f"extrapolate to depth > {depth_x + 1}, got {depth}")
    names_x = [g["name"] for g in doc_x["graphs"]]
    if names_x != [g["name"] for g in doc_y["graphs"]]:
        raise NotExtrapolable("the two captures have different graphs")
    graphs = [_GraphExtrapolation(gx, gy).build(depth - depth_x - 1)
              for gx, gy in zip(doc_x["graphs"], doc_y["graphs"])]
    meta = dict(doc_y["meta"])
    return {"schema": doc_y["schema"], "meta": meta, "blocks": [], "graphs": graphs}
