"""Third-party files copied unchanged, each with its origin and licence in SOURCES.md."""
