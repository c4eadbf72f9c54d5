"""Unit tests of spade eval and the pool metrics."""
