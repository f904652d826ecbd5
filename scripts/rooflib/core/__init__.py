"""Core: settings, errors, HTTP, files, output, secrets, signals, statistics and the command-line plumbing every script shares."""
