"""The record order of a run, the same for any number of hosts: host h of H reads its slice of
every global batch.

Grain's own sharding (`IndexSampler(shard_options=...)`) gives each host a contiguous part of
the records, shuffled on its own, so a run on 2 hosts sees other batches than the same run on 1.
`GlobalBatchSampler` instead keeps the one-host sequence (the unsharded `IndexSampler`: the
shuffle, and the augmentation rng, which Grain draws from `seed + position`) and cuts every
global batch of `batch_size * H` records into H consecutive slices: host h's batch n is records
h*b .. h*b+b-1 of the one-host batch n. Grain's DataLoader asks host h for positions i*H + h and
hands its `worker_count` workers alternate positions; the mapping below undoes both, so the
global batches equal the one-host batches at the same worker count. With H = 1 it is the
identity (the same order, and the same `repr`, which Grain checks on restore, as before).
"""

from __future__ import annotations

import grain.python as grain


class GlobalBatchSampler:
    """Grain sampler: host `shard_options.shard_index` of `shard_count`, `batch_size` records
    per host per batch, `worker_count` Grain workers (0 counts as 1)."""

    def __init__(self, num_records: int, shard_options: grain.ShardOptions, batch_size: int,
                 worker_count: int, *, shuffle: bool, seed: int,
                 num_epochs: int | None = None):
        self._one_host = grain.IndexSampler(num_records=num_records, shuffle=shuffle,
                                            num_epochs=num_epochs, seed=seed,
                                            shard_options=grain.NoSharding())
        self._hosts = shard_options.shard_count
        self._batch = batch_size
        self._workers = max(1, worker_count)
        # As before for one host (old checkpoints restore); what this sampler is otherwise.
        self._repr = repr(grain.IndexSampler(
            num_records=num_records, shard_options=shard_options, shuffle=shuffle,
            num_epochs=num_epochs, seed=seed))
        if self._hosts > 1:
            self._repr = (f"GlobalBatchSampler(num_records={num_records}, hosts={self._hosts}, "
                          f"batch_size={batch_size}, workers={self._workers}, "
                          f"shuffle={shuffle}, num_epochs={num_epochs}, seed={seed})")
        total = len(self._one_host)
        if num_epochs is not None and self._hosts > 1:  # whole rounds of every worker's batch
            per_round = self._batch * self._hosts * self._workers
            total = total // per_round * per_round
        self._len = total

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return self._repr

    def position(self, index: int) -> int:
        """The one-host position of the DataLoader's `index` (= i * hosts + host)."""
        if self._hosts == 1:
            return index
        local, host = divmod(index, self._hosts)
        within, worker = divmod(local, self._workers)  # Grain's worker `worker`, its `within`-th
        batch, slot = divmod(within, self._batch)      # its batch `batch`, slot `slot`
        return worker + self._workers * (batch * self._batch * self._hosts
                                         + host * self._batch + slot)

    def __getitem__(self, index: int) -> grain.RecordMetadata:
        if index < 0 or index >= self._len:
            raise IndexError(f"index {index} is outside 0..{self._len - 1}")
        meta = self._one_host[self.position(index)]
        return grain.RecordMetadata(index=index, record_key=meta.record_key, rng=meta.rng)
