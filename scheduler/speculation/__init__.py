"""Speculative decoding, the scheduler's side: who proposes draft tokens, and how many.

A proposer guesses the next tokens of a decoding sequence; the step computes the sequence's last
token and its k drafts as one chunk of k + 1 query tokens, and the engine keeps the longest
prefix of drafts the target model itself would have produced (engine/speculative.py). The
n-gram proposer (prompt lookup) is pure and lives here; a draft model (engine/draft_model.py)
plugs into the same `Proposer` seam from the engine, as a learned head (EAGLE, MTP) would.
Which of them proposes is decided in one place (speculator.py). How many of a proposal's drafts
a step verifies is the measured odds' call (odds.py), against what a row costs this machine
(row_cost.py).
"""

from scheduler.speculation.history import OutputHistory
from scheduler.speculation.ngram import NgramProposer
from scheduler.speculation.odds import MODEL_KIND, DraftOdds
from scheduler.speculation.proposer import Proposal, Proposer, SpeculativeConfig
from scheduler.speculation.row_cost import RowCost, break_even
from scheduler.speculation.speculator import Speculator, speculator_for

__all__ = [
    "MODEL_KIND",
    "DraftOdds",
    "NgramProposer",
    "OutputHistory",
    "Proposal",
    "Proposer",
    "RowCost",
    "SpeculativeConfig",
    "Speculator",
    "break_even",
    "speculator_for",
]
