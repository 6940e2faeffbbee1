"""Pinned and preloaded documents: the policy over the tiers' pins.

A document is the open start of the prompts that will ask about it (prompts.render_document). Its
reusable blocks are the full blocks of the tokens every extension starts with; caching it computes
them (a prefill with no generated token) and, if pinned, keeps them in every lower tier for good.

Policy here, mechanism in the tiers (`LowerTier.pin`): a document's id is its last full block's
chain hash (the same document under the same salt is the same document, in every process and after
restarts), pinning needs a CPU or disk tier, and pinned blocks may take at most `pin_share` of each
of them (the remote tier's server evicts by its own policy: it gets the blocks, but no pin to keep).
Pins are owned by the document's id; the tiers keep the document's description with its pin, so the
pinned documents of a persistent tier (disk) are known again after a restart.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvstrata.engine.hashing import BlockHasher
from kvstrata.engine.prompts import RenderedDocument
from kvstrata.tiers.hierarchy import TierHierarchy

DOCUMENT_ID_PREFIX = "doc-"


class PinLimitError(ValueError):
    """Pinning a document would take more than `cache.pin_share` of a tier."""


class UnknownDocumentError(KeyError):
    def __str__(self) -> str:
        return f"no document with id {self.args[0]!r}"


@dataclass(frozen=True)
class DocumentPlan:
    """What caching a document will compute and keep, decided before any work is done."""

    document_id: str
    token_ids: list[int]
    block_hashes: list[bytes]         # of its reusable full blocks
    block_tokens: list[list[int]]
    cache_salt: str | None
    pin: bool

    @property
    def salted(self) -> bool:
        return self.cache_salt is not None


@dataclass
class Document:
    """A cached document as the API reports it. Every figure is read from the tiers when asked."""

    id: str
    num_tokens: int                   # of the rendered document
    num_cached_tokens: int            # in its reusable full blocks: what a question about it finds cached
    pinned: bool
    salted: bool                      # cached under a cache_salt (the salt itself is never reported)
    blocks_by_tier: dict[str, int] = field(default_factory=dict)  # its blocks each tier holds now


@dataclass
class _Entry:
    num_tokens: int
    block_hashes: list[bytes]
    salted: bool
    pinned: bool

    def info(self) -> dict:
        return {"num_tokens": self.num_tokens, "salted": self.salted}


class DocumentRegistry:
    def __init__(self, hierarchy: TierHierarchy, hasher: BlockHasher, block_size: int, pin_share: float):
        assert 0 < pin_share <= 1
        self.hierarchy = hierarchy
        self.hasher = hasher
        self.block_size = block_size
        self.pin_share = pin_share
        self._entries: dict[str, _Entry] = {}
        # Pinned documents a persistent tier kept across a restart: known again, pinned in every tier.
        for owner, pin in hierarchy.pins().items():
            if owner.startswith(DOCUMENT_ID_PREFIX):
                self._entries[owner] = _Entry(int(pin.info.get("num_tokens", len(pin.block_hashes) * block_size)),
                                              list(pin.block_hashes), bool(pin.info.get("salted")), pinned=True)
        hierarchy.restore_pins()

    def plan(self, document: RenderedDocument, cache_salt: str | None, pin: bool) -> DocumentPlan:
        """Check that the document can be cached (and pinned) as asked; raises ValueError (one line) if not."""
        num_blocks = document.num_stable_tokens // self.block_size
        if num_blocks < 1:
            raise ValueError(f"the document has {len(document.token_ids)} tokens, {document.num_stable_tokens} of "
                             f"them reusable by the prompts that extend it: fewer than one block of "
                             f"{self.block_size}, so there is nothing to cache")
        token_ids = document.token_ids
        hashes = self.hasher.hash(token_ids[:num_blocks * self.block_size], cache_salt=cache_salt)
        bs = self.block_size
        plan = DocumentPlan(DOCUMENT_ID_PREFIX + hashes[-1].hex(), list(token_ids), hashes,
                            [token_ids[k * bs:(k + 1) * bs] for k in range(num_blocks)], cache_salt, pin)
        if pin:
            self._check_pin_room(plan)
        return plan

    def _check_pin_room(self, plan: DocumentPlan) -> None:
        keeping = [tier for tier in self.hierarchy.lower_tiers if tier.keeps_pins]  # the remote tier does not
        if not keeping:
            raise ValueError("pin: pinning needs a CPU or disk tier (cache.tiers.cpu or cache.tiers.disk)")
        for tier in keeping:
            pinned = {h for owner, p in tier.pins().items() if owner != plan.document_id for h in p.block_hashes}
            needed = len(pinned | set(plan.block_hashes))
            capacity = tier.stats().capacity_blocks
            allowed = math.floor(self.pin_share * capacity)
            if needed > allowed:
                raise PinLimitError(
                    f"cache.pin_share: pinning {plan.document_id} ({len(plan.block_hashes)} blocks) would pin "
                    f"{needed} blocks of the {tier.name} tier, more than the {allowed} of its {capacity} that a "
                    f"pin_share of {self.pin_share:g} allows; unpin a document or raise cache.pin_share")

    def register(self, plan: DocumentPlan) -> Document:
        """Record a computed document; pin it (copying its blocks into every lower tier) or unpin it, as planned."""
        entry = _Entry(len(plan.token_ids), plan.block_hashes, plan.salted, plan.pin)
        if plan.pin:
            self._check_pin_room(plan)  # again: another document may have been pinned meanwhile
            self.hierarchy.pin(plan.document_id, plan.block_hashes, plan.block_tokens, entry.info())
        else:
            self.hierarchy.unpin(plan.document_id)
        self._entries[plan.document_id] = entry
        return self._describe(plan.document_id, entry)

    def list(self) -> list[Document]:
        return [self._describe(doc_id, entry) for doc_id, entry in self._entries.items()]

    def get(self, document_id: str) -> Document:
        _check_document_id(document_id)
        entry = self._entries.get(document_id)
        if entry is None:
            raise UnknownDocumentError(document_id)
        return self._describe(document_id, entry)

    def unpin(self, document_id: str) -> Document:
        """Forget a document: its blocks become ordinary cached blocks (evictable by LRU again)."""
        _check_document_id(document_id)
        entry = self._entries.pop(document_id, None)
        if entry is None:
            raise UnknownDocumentError(document_id)
        self.hierarchy.unpin(document_id)
        entry.pinned = False
        return self._describe(document_id, entry)

    def forget_all(self) -> None:
        """Forget every document, without touching the tiers (for a reset that has emptied them all)."""
        self._entries.clear()

    def _describe(self, document_id: str, entry: _Entry) -> Document:
        return Document(document_id, entry.num_tokens, len(entry.block_hashes) * self.block_size, entry.pinned,
                        entry.salted, self.hierarchy.blocks_by_tier(entry.block_hashes))


def _check_document_id(document_id: object) -> None:
    # ids are strings; a list or a dict would otherwise fail the lookup itself (unhashable)
    if not isinstance(document_id, str):
        raise TypeError(f"document_id must be a string (a document's id), got {type(document_id).__name__}")
