"""Build one torch_dist checkpoint from the dumps of surviving replicas (no process group).

``python -m megatron.training.replica_merge DUMP MEMORY_DIR [--newest N]`` is what the
supervisor runs once an attempt's survivors have dumped (``megatron.training.replicas``):

1. :func:`ftmaster.recovery.replicas.choose_cut` picks the iteration and one survivor per
   (TP, PP) shard from the reports (their checksums must agree between replicas);
2. each chosen dump's files are checked against its report, and its local plan (the one-rank
   ``.metadata``) is read; a missing or damaged one refuses the merge;
3. the plans are merged into one global ``Metadata``, shards held by several chosen ranks
   (TP-replicated layer norms) kept once, after checking their checksums agree;
   With the distributed optimizer, the optimizer tensors are not in the plans: each chosen
   survivor's slices of them (``optimizer_shard.pt``) are put together into the chunks a
   regular save stores (:func:`optimizer_chunks`), written to one more data file;
4. :func:`coverage_problem` checks that every tensor is covered exactly once and every
   sharded object has all its pieces. torch's own plan validation skips this when there is
   one plan, and a checkpoint missing a shard would then load silently with wrong values;
5. the checkpoint is built beside ``iter_<N>`` (the chosen shards hard-linked, ``.metadata``,
   ``common.pt``, ``metadata.json``, the manifest with a checksum per file), renamed into
   place, and the memory tier's tracker advanced, never backwards.

It prints one JSON line: ``{"iteration", "shards", "seconds", "path", "bytes"}`` when merged
(exit 0), ``{"refused": REASON}`` when there is no complete cut (exit 3); a usage error
exits 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import pickle
import re
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ftmaster.recovery.checkpoints import (
    COMMON_FILE,
    CONFIG_FILE,
    DCP_METADATA_FILE,
    advance_tracker_locked,
    iteration_dir,
    read_tracker,
    tracker_lock,
)
from ftmaster.recovery.manifest import FileDigest, digest_bytes, digest_file, write_manifest
from ftmaster.recovery.replicas import (
    SHARD_FILE,
    STAGING_PREFIX,
    NoCut,
    Report,
    choose_cut,
    item_key,
    rank_dump_dir,
    read_reports,
)

REFUSED = 3
# megatron-core's CheckpointingConfig as dist_checkpointing.save writes it (kept literal: the
# merge runs in a fresh interpreter during recovery, and megatron-core's import takes ~2 s).
CHECKPOINTING_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                        "common_backend": "torch", "common_backend_version": 1}
OPTIMIZER_FILE = "__optimizer_0.distcp"
"""The distributed optimizer's chunks, put together from the survivors' slices."""
_OBJECT_SHARD = re.compile(r"^(?P<key>.*)/shard_(?P<offset>[\d.]+)_(?P<shape>[\d.]+)$")


@dataclass(frozen=True)
class Merged:
    iteration: int
    shards: int
    seconds: float
    path: Path
    bytes: int


def merge(folder: Path, memory_dir: Path, newest: int | None = None) -> Merged:
    """The checkpoint of the newest complete cut in ``folder``'s dumps, in ``memory_dir``;
    NoCut when there is none, or when the newest checkpoint (``newest``) is as recent."""
    start = time.perf_counter()
    reports = {r.rank: r for r in read_reports(folder)}
    cut = choose_cut(list(reports.values()))
    newest = max(n for n in (newest, read_tracker(memory_dir), -1) if n is not None)
    if cut.iteration <= newest:
        raise NoCut(f"the newest checkpoint (iteration {newest}) is as recent as the "
                    f"survivors' state (iteration {cut.iteration})")
    plans = {rank: _checked_plan(folder, reports[rank]) for rank in cut.ranks}
    metadata, sources = merged_metadata(plans, reports)
    chunks = optimizer_chunks(_optimizer_slices(folder, cut.ranks, reports), reports)
    add_chunks(metadata, chunks)
    problem = coverage_problem(metadata)
    if problem is not None:
        raise NoCut(f"the merged plans do not cover the model: {problem}")
    path, size = _write_checkpoint(folder, memory_dir, cut.iteration, metadata, sources,
                                   reports, cut.ranks[0], chunks)
    return Merged(cut.iteration, len(cut.ranks), time.perf_counter() - start, path, size)


def _checked_plan(folder: Path, report: Report) -> Metadata:
    """A chosen survivor's plan, once its files match its report."""
    dump = rank_dump_dir(folder, report.rank)
    for name, entry in sorted((report.files or {}).items()):
        try:
            found = digest_file(dump / name)
        except OSError as error:
            raise NoCut(f"rank {report.rank}'s dump lacks {name}: {error.strerror}") from None
        if found.digest != entry["digest"] or found.bytes != entry["bytes"]:
            raise NoCut(f"rank {report.rank}'s {name} does not match its report: damaged")
    if DCP_METADATA_FILE not in (report.files or {}):
        raise NoCut(f"rank {report.rank}'s report lists no plan ({DCP_METADATA_FILE})")
    return FileSystemReader(dump).read_metadata()


def _merged_file_name(rank: int, name: str) -> str:
    return f"__{rank}_{name.removeprefix('__0_')}"


def merged_metadata(plans: dict[int, Metadata], reports: dict[int, Report]):
    """One global Metadata from the chosen ranks' plans, and the data files it reads (merged
    name -> source path). Each item is taken from the first rank holding it; a later copy
    must have the same checksum."""
    state_dict_metadata, storage_data, sources, first_holder = {}, {}, {}, {}
    for plan in plans.values():  # every tensor a plan declares, even with no chunk stored
        for fqn, entry in plan.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata) and fqn not in state_dict_metadata:
                state_dict_metadata[fqn] = TensorStorageMetadata(entry.properties, entry.size, [])
    for rank, plan in plans.items():
        items = reports[rank].items or {}
        for index, info in plan.storage_data.items():
            key = item_key(index.fqn, index.offset)
            if key in first_holder:
                holder = first_holder[key]
                if (reports[holder].items or {}).get(key) != items.get(key):
                    raise NoCut(f"ranks {holder} and {rank} hold different copies of {key}")
                continue
            first_holder[key] = rank
            name = _merged_file_name(rank, info.relative_path)
            sources[name] = (rank, info.relative_path)
            storage_data[MetadataIndex(index.fqn, index.offset)] = replace(info, relative_path=name)
            _add_item(state_dict_metadata, plan.state_dict_metadata[index.fqn], index)
    template = next(iter(plans.values()))
    merged = Metadata(state_dict_metadata, planner_data=template.planner_data,
                      storage_data=storage_data, storage_meta=template.storage_meta,
                      version=template.version)
    return merged, sources


@dataclass(frozen=True)
class Chunk:
    """One stored chunk of a distributed optimizer's tensor, put together from slices."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_size: tuple[int, ...]
    values: torch.Tensor


def _optimizer_slices(folder: Path, ranks: tuple[int, ...], reports: dict[int, Report]) -> dict:
    """rank -> its slices of the optimizer state (an empty dict without them); the files
    were checked against their reports with the plans."""
    slices = {}
    for rank in ranks:
        path = rank_dump_dir(folder, rank) / SHARD_FILE
        if SHARD_FILE in (reports[rank].files or {}):
            slices[rank] = torch.load(path, map_location="cpu", weights_only=True)
        elif reports[rank].optimizer_shards > 1:
            raise NoCut(f"rank {reports[rank].rank}'s report lists no optimizer shard ({SHARD_FILE})")
    return slices


def optimizer_chunks(slices: dict[int, dict], reports: dict[int, Report]) -> list[Chunk]:
    """The chunks of the distributed optimizer's tensors, each from the slices of the chosen
    survivors (one per optimizer shard); a slice held by several of them (TP-replicated
    tensors) is taken once, after its checksums agree. A chunk whose slices do not cover it
    exactly once refuses the merge."""
    pieces: dict[tuple[str, tuple[int, ...]], dict[tuple[int, int], tuple[int, dict]]] = {}
    for rank, held in sorted(slices.items()):
        for key, piece in held.items():
            ranges = pieces.setdefault((piece["fqn"], tuple(piece["offsets"])), {})
            span = (int(piece["start"]), int(piece["end"]))
            if span in ranges:
                holder = ranges[span][0]
                if (reports[holder].items or {}).get(key) != (reports[rank].items or {}).get(key):
                    raise NoCut(f"ranks {holder} and {rank} hold different copies of {key}")
                continue
            ranges[span] = (rank, piece)
    return [_chunk(fqn, offsets, ranges) for (fqn, offsets), ranges in sorted(pieces.items())]


def _chunk(fqn: str, offsets: tuple[int, ...], ranges: dict) -> Chunk:
    first = next(iter(ranges.values()))[1]
    sizes, values = tuple(first["sizes"]), None
    numel, covered = math.prod(sizes), 0
    for (start, end), (_, piece) in sorted(ranges.items()):
        if start != covered:
            break
        if values is None:
            values = torch.empty(numel, dtype=piece["values"].dtype)
        values[start:end] = piece["values"]
        covered = end
    if covered != numel:
        raise NoCut(f"{fqn}: the chunk at {list(offsets)} is not covered exactly once by the "
                    f"survivors' optimizer shards (its first {covered} of {numel} elements)")
    return Chunk(fqn, offsets, sizes, tuple(first["global_size"]), values.reshape(sizes))


def add_chunks(metadata: Metadata, chunks: list[Chunk]) -> None:
    """Declare the chunks in the merged plan (their storage is set when they are written)."""
    for chunk in chunks:
        entry = metadata.state_dict_metadata.setdefault(chunk.fqn, TensorStorageMetadata(
            TensorProperties(dtype=chunk.values.dtype), torch.Size(chunk.global_size), []))
        entry.chunks.append(ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.sizes)))
        metadata.storage_data[MetadataIndex(chunk.fqn, chunk.offsets)] = _StorageInfo(
            OPTIMIZER_FILE, 0, 0)


def _write_chunks(path: Path, chunks: list[Chunk], metadata: Metadata) -> FileDigest:
    """The chunks as torch_dist stores tensors (one ``torch.save`` after another)."""
    with open(path, "wb") as stream:
        for chunk in chunks:
            offset = stream.tell()
            torch.save(chunk.values, stream)
            metadata.storage_data[MetadataIndex(chunk.fqn, chunk.offsets)] = _StorageInfo(
                OPTIMIZER_FILE, offset, stream.tell() - offset)
    return digest_file(path)


def _add_item(merged: dict, entry, index: MetadataIndex) -> None:
    if not isinstance(entry, TensorStorageMetadata):
        merged[index.fqn] = entry
        return
    chunk = next((c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset)), None)
    if chunk is not None:  # else stored but undeclared: the coverage check finds the hole
        merged[index.fqn].chunks.append(ChunkStorageMetadata(chunk.offsets, chunk.sizes))


def coverage_problem(metadata: Metadata) -> str | None:
    """The first tensor not covered exactly once, or sharded object missing a piece, or
    item without stored bytes; None when the checkpoint is whole."""
    pieces: dict[tuple[str, tuple[int, ...]], set[tuple[int, ...]]] = {}
    for fqn, entry in sorted(metadata.state_dict_metadata.items()):
        if isinstance(entry, TensorStorageMetadata):
            problem = _tensor_problem(fqn, entry, metadata.storage_data)
            if problem is not None:
                return problem
            continue
        if MetadataIndex(fqn) not in metadata.storage_data:
            return f"{fqn} has no stored bytes"
        found = _OBJECT_SHARD.match(fqn)
        if found:
            shape = tuple(int(s) for s in found["shape"].split("."))
            offset = tuple(int(s) for s in found["offset"].split("."))
            pieces.setdefault((found["key"], shape), set()).add(offset)
    for (key, shape), offsets in sorted(pieces.items()):
        for offset in itertools.product(*(range(s) for s in shape)):
            if offset not in offsets:
                return f"object {key} lacks its piece {offset} of {shape}"
    return None


def _tensor_problem(fqn: str, entry: TensorStorageMetadata, storage_data) -> str | None:
    total = math.prod(entry.size)
    covered = 0
    for chunk in entry.chunks:
        if any(o < 0 or o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, entry.size)):
            return f"{fqn}: chunk at {list(chunk.offsets)} lies outside {list(entry.size)}"
        if MetadataIndex(fqn, chunk.offsets) not in storage_data:
            return f"{fqn}: chunk at {list(chunk.offsets)} has no stored bytes"
        covered += math.prod(chunk.sizes)
    for a, b in itertools.combinations(entry.chunks, 2):
        if all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in
               zip(a.offsets, a.sizes, b.offsets, b.sizes)):
            return f"{fqn}: chunks at {list(a.offsets)} and {list(b.offsets)} overlap"
    if covered != total:
        return f"{fqn}: {covered} of its {total} elements are covered"
    return None


def _write_checkpoint(folder: Path, memory_dir: Path, iteration: int, metadata: Metadata,
                      sources: dict, reports: dict[int, Report], first: int,
                      chunks: list[Chunk]) -> tuple[Path, int]:
    """Build it beside its place, then rename it in and advance the tracker (one lock)."""
    target = iteration_dir(memory_dir, iteration)
    staging = target.with_name(f".{target.name}{STAGING_PREFIX}{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    try:
        written = {OPTIMIZER_FILE: _write_chunks(staging / OPTIMIZER_FILE, chunks, metadata)
                   } if chunks else {}
        files = {**_stage_files(folder, staging, metadata, sources, reports, first), **written}
        write_manifest(staging, "replica", iteration, files)
        with tracker_lock(memory_dir):
            if target.exists():  # an unfinished save of the same iteration
                target.rename(target.with_name(f"{target.name}.discarded-{uuid.uuid4().hex[:8]}"))
            staging.rename(target)
            advance_tracker_locked(memory_dir, iteration)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target, sum(f.bytes for f in files.values())


def _stage_files(folder: Path, staging: Path, metadata: Metadata, sources: dict,
                 reports: dict[int, Report], first: int) -> dict[str, FileDigest]:
    """The chosen shards (hard links: no copy in node memory), the plan, ``common.pt`` of
    the first chosen rank and ``metadata.json``; the checksums the reports carry."""
    files = {}
    for name, (rank, source_name) in sorted(sources.items()):
        _link_or_copy(rank_dump_dir(folder, rank) / source_name, staging / name)
        files[name] = _report_digest(reports[rank], source_name)
    _link_or_copy(rank_dump_dir(folder, first) / COMMON_FILE, staging / COMMON_FILE)
    files[COMMON_FILE] = _report_digest(reports[first], COMMON_FILE)
    for name, data in ((DCP_METADATA_FILE, pickle.dumps(metadata)),
                       (CONFIG_FILE, json.dumps(CHECKPOINTING_CONFIG).encode())):
        (staging / name).write_bytes(data)
        files[name] = digest_bytes(data)
    return files


def _report_digest(report: Report, name: str) -> FileDigest:
    entry = report.files[name]
    return FileDigest(int(entry["bytes"]), str(entry["digest"]))


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem, or none that links
        shutil.copyfile(source, target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron.training.replica_merge",
        description="Merge the dumps of surviving replicas into one torch_dist checkpoint.")
    parser.add_argument("dump", type=Path, help="the attempt's dump folder (rank_<R>.json ...)")
    parser.add_argument("memory_dir", type=Path, help="the memory tier: the checkpoint goes there")
    parser.add_argument("--newest", type=int, default=None,
                        help="the newest checkpoint's iteration elsewhere (e.g. --save's): merge "
                             "only a newer one (the memory tier's tracker is read here)")
    args = parser.parse_args(argv)
    if not args.dump.is_dir():
        parser.error(f"{args.dump} is not a folder")
    try:
        merged = merge(args.dump, args.memory_dir, args.newest)
    except NoCut as refusal:
        print(json.dumps({"refused": str(refusal)}), flush=True)
        return REFUSED
    except OSError as error:
        print(json.dumps({"refused": f"writing the checkpoint failed: {error}"}), flush=True)
        return REFUSED
    print(json.dumps({"iteration": merged.iteration, "shards": merged.shards,
                      "seconds": round(merged.seconds, 4), "path": str(merged.path),
                      "bytes": merged.bytes}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
