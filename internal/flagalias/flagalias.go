// Package flagalias keeps a renamed command-line flag's old name working
// for a while: the old name sets the new flag and says, once, that it is
// deprecated and what to write instead, so that a chart or a script that
// still passes it goes on working and its log says what to change.
package flagalias

import (
	"flag"
	"fmt"
)

// Deprecated defines old on fs as an alias of the flag current, which
// must be defined already: setting old sets current, and warn is called
// with a message naming both the first time old is given.
func Deprecated(fs *flag.FlagSet, old, current string, warn func(msg string)) {
	target := fs.Lookup(current)
	if target == nil {
		panic(fmt.Sprintf("flagalias: --%s is an alias of --%s, which is not defined", old, current))
	}
	a := &alias{target: target.Value, old: old, current: current, warn: warn}
	usage := fmt.Sprintf("deprecated: use --%s", current)
	if b, ok := target.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
		fs.Var(boolAlias{a}, old, usage)
		return
	}
	fs.Var(a, old, usage)
}

// Message is what warn is given for an old name.
func Message(old, current string) string {
	return fmt.Sprintf("--%s is deprecated and will be removed: use --%s", old, current)
}

type alias struct {
	target       flag.Value
	old, current string
	warn         func(string)
	warned       bool
}

func (a *alias) String() string {
	if a == nil || a.target == nil {
		return ""
	}
	return a.target.String()
}

func (a *alias) Set(s string) error {
	if !a.warned && a.warn != nil {
		a.warned = true
		a.warn(Message(a.old, a.current))
	}
	return a.target.Set(s)
}

// boolAlias lets the old name of a boolean flag stand alone (--old, no value).
type boolAlias struct{ *alias }

func (boolAlias) IsBoolFlag() bool { return true }
