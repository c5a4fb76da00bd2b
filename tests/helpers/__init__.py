"""What the test modules share, imported by them and by the conftest files (never one test
module by another)."""
