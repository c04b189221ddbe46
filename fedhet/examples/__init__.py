"""Small runnable examples of using fedhet's pieces in your own project (see ``docs/reuse.md``)."""
