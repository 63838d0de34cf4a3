"""TorchTitan's dataloader and tokenizer over ``packed.PackedSequences`` (the packed
variable-length HSTU data; its length distribution and metadata are described there) or
``rows.RowSequences`` (one sequence per row with the metadata of the mask it trains)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer

from .masks import resolve_mask
from .packed import IGNORE_INDEX, PackedSequences, pack_sequences
from .rows import RowSequences

__all__ = ["PackedSequences", "RowSequences", "PackedSequenceDataLoader", "SyntheticTokenizer",
           "pack_sequences", "IGNORE_INDEX", "DATASETS"]

DATASETS = ("auto", "packed_hstu_lognormal", "rows")


class PackedSequenceDataLoader(ParallelAwareDataloader):
    """TorchTitan dataloader over ``PackedSequences`` or ``RowSequences``."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "auto"
        """packed_hstu_lognormal (packed sequences: documents from positions, HSTU fields),
        rows (one sequence per row with ``mask``'s fields), or auto: rows where ``mask``'s
        fields can be drawn per row, packed otherwise."""

        mask: str = ""
        """The mask whose fields ``rows`` draws (the trainer sets the model's)."""

        mask_options: dict[str, int] = field(default_factory=dict)

        vocab_size: int = 2048
        mu: float = 6.0
        """log-length mean (lognormal sequence lengths)"""
        sigma: float = 1.0
        """log-length standard deviation"""
        min_len: int = 16
        max_len: int = 0
        """longest sequence (0: the row's capacity)"""
        ctx_len: int = 8
        target_frac: float = 0.2
        group_size: int = 64
        seed: int = 0

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer=None,
                 seq_len: int, local_batch_size: int, snapshot_every_n_steps: int | None = 1,
                 **kwargs):
        if config.dataset not in DATASETS:
            raise ValueError(f"dataloader.dataset: one of {DATASETS}, got {config.dataset!r}")
        if rows_data(config):
            ds = RowSequences(seq_len, config.mask, config.mask_options,
                              vocab_size=config.vocab_size, seed=config.seed, dp_rank=dp_rank,
                              dp_world_size=dp_world_size)
        else:
            ds = PackedSequences(seq_len, vocab_size=config.vocab_size, mu=config.mu,
                                 sigma=config.sigma, min_len=config.min_len,
                                 max_len=config.max_len or None, ctx_len=config.ctx_len,
                                 target_frac=config.target_frac, group_size=config.group_size,
                                 seed=config.seed, dp_rank=dp_rank, dp_world_size=dp_world_size)
        super().__init__(ds, dp_rank=dp_rank, dp_world_size=dp_world_size,
                         batch_size=local_batch_size, num_workers=0,
                         snapshot_every_n_steps=snapshot_every_n_steps)


def rows_data(config: PackedSequenceDataLoader.Config) -> bool:
    """Whether ``config`` loads ``RowSequences`` (else ``PackedSequences``)."""
    if config.dataset != "auto":
        return config.dataset == "rows"
    return bool(config.mask) and resolve_mask(config.mask, config.mask_options).rows is not None


class SyntheticTokenizer(BaseTokenizer):
    """A tokenizer for synthetic ids (no files): ids are their own text."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 2048

    def __init__(self, config: Config, **kwargs):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.eos_id, self.bos_id = 0, 0

    def encode(self, text, *args, **kwargs) -> list[int]:
        return [int(t) % self.vocab_size for t in str(text).split()]

    def decode(self, ids, *args, **kwargs) -> str:
        return " ".join(str(int(i)) for i in ids)

    def get_vocab_size(self) -> int:
        return self.vocab_size
