"""The roles' ledgers of what they did, their replay, and the audit of a run (docs/ledger.md)."""
