"""The process tier: tests that start local processes or open local sockets (the CLI as a
subprocess, agents and fork servers on this machine, a local torchrun) but need no
namespace node (docs/testbed.md, "The suite's tiers"). No fixtures of its own."""
