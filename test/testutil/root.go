package testutil

import "github.com/mountplan/mountplan/internal/testenv"

// What a test does when the machine lacks something it needs: skip outside
// CI, fail under CI=true, naming what is missing (package testenv).
var (
	RequireRoot     = testenv.RequireRoot
	RequireCommands = testenv.RequireCommands
	RequireFile     = testenv.RequireFile
	Missing         = testenv.Missing
)
