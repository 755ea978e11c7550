"""In-tree backends. Each module registers its class when imported (on first use)."""
