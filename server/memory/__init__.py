"""Memory: the budget admission and the batch loop work within, the ledger of what calls
hold until they are answered, the probes that measure a batch, and the fitted model
(`attnserve memory-profile` writes it)."""
