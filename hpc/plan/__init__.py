"""Pure placement: which node runs what. No I/O, no clock."""
