package flagalias

import (
	"flag"
	"io"
	"testing"
)

func TestDeprecatedSetsTheNewFlagAndWarnsOnce(t *testing.T) {
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	ep := fs.String("mounter-endpoint", "", "")
	rm := fs.Bool("remove-mount-point", false, "")
	var warnings []string
	warn := func(m string) { warnings = append(warnings, m) }
	Deprecated(fs, "endpoint", "mounter-endpoint", warn)
	Deprecated(fs, "remove-target", "remove-mount-point", warn)
	if err := fs.Parse([]string{"--endpoint", "unix:///a", "--endpoint=unix:///b", "--remove-target"}); err != nil {
		t.Fatal(err)
	}
	if *ep != "unix:///b" || !*rm {
		t.Fatalf("the old names set mounter-endpoint %q, remove-mount-point %v", *ep, *rm)
	}
	want := []string{Message("endpoint", "mounter-endpoint"), Message("remove-target", "remove-mount-point")}
	if len(warnings) != 2 || warnings[0] != want[0] || warnings[1] != want[1] {
		t.Fatalf("warnings %q, want %q (once per old name)", warnings, want)
	}
}

func TestNewNameDoesNotWarn(t *testing.T) {
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	ep := fs.String("driver-name", "d", "")
	warned := false
	Deprecated(fs, "driver", "driver-name", func(string) { warned = true })
	if err := fs.Parse([]string{"--driver-name", "other"}); err != nil {
		t.Fatal(err)
	}
	if *ep != "other" || warned {
		t.Fatalf("driver-name %q, warned %v", *ep, warned)
	}
	if u := fs.Lookup("driver").Usage; u != "deprecated: use --driver-name" {
		t.Errorf("usage of the old name: %q", u)
	}
}
