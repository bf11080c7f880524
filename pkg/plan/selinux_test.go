package plan

import (
	"errors"
	"testing"

	"github.com/mountplan/mountplan/internal/errdefs"
)

func TestParseContext(t *testing.T) {
	const kubelet = `context="system_u:object_r:container_file_t:s0:c1,c2"`
	tests := []struct {
		opt   string
		label string // "" with ok: refused
		ok    bool   // a context option at all
	}{
		{kubelet, "system_u:object_r:container_file_t:s0:c1,c2", true},
		{`context=system_u:object_r:container_file_t:s0`, "system_u:object_r:container_file_t:s0", true},
		{`context="system_u:object_r:svirt_sandbox_file_t:s0:c0.c255,c300"`, "system_u:object_r:svirt_sandbox_file_t:s0:c0.c255,c300", true},
		{`context="u:r:t:s0-s0:c0.c1023"`, "u:r:t:s0-s0:c0.c1023", true},
		{`context=user_u:object_r:t`, "user_u:object_r:t", true},
		{"nosuid", "", false},
		{"fscontext=system_u:object_r:t:s0", "", false},

		// Refused: anything a label cannot hold.
		{`context=system_u:object_r:container_file_t:s0:c1,c2`, "", true}, // comma outside quotes
		{`context="system_u:object_r:t:s0:c1,c2`, "", true},               // unclosed quote
		{`context="system_u:object_r:t:s0",nosuid`, "", true},
		{`context="system_u:object_r:t:s0,dev"`, "", true},
		{`context="system_u:object_r:t:s0:c1,suid"`, "", true},
		{"context=\"system_u:object_r:t:s0\nsuid\"", "", true},
		{"context=\"system_u:object_r:t:s0\x00\"", "", true},
		{`context="system_u:object_r:t:s0" `, "", true},
		{`context=""`, "", true},
		{`context=`, "", true},
		{`context="u:r"`, "", true},
		{`context="u:r:t:s0:c1,,c2"`, "", true},
		{`context="u:r:t:s0:c1,"`, "", true},
		{`context="u:r:t:s0=x"`, "", true},
		{`context="u:r:t:/dev/sda"`, "", true},
		{`context='u:r:t:s0'`, "", true},
		{`context=""u:r:t:s0""`, "", true},
	}
	for _, tc := range tests {
		t.Run(tc.opt, func(t *testing.T) {
			label, ok, err := ParseContext(tc.opt)
			if ok != tc.ok {
				t.Fatalf("ParseContext(%q): ok %t, want %t", tc.opt, ok, tc.ok)
			}
			if !ok {
				return
			}
			if tc.label == "" {
				if !errors.Is(err, errdefs.ErrInvalidArgument) {
					t.Fatalf("ParseContext(%q) = %q, %v; want InvalidArgument", tc.opt, label, err)
				}
				if perr := (Policy{}).CheckOption(tc.opt); !errors.Is(perr, errdefs.ErrInvalidArgument) {
					t.Fatalf("the policy lets %q through: %v", tc.opt, perr)
				}
				return
			}
			if err != nil || label != tc.label {
				t.Fatalf("ParseContext(%q) = %q, %v; want %q", tc.opt, label, err, tc.label)
			}
			if err := (Policy{}).CheckOption(tc.opt); err != nil {
				t.Fatalf("the policy refuses %q: %v", tc.opt, err)
			}
		})
	}
}

func TestContextOf(t *testing.T) {
	a, b := ContextOption("u:r:a_t:s0:c1,c2"), ContextOption("u:r:b_t:s0:c3,c4")
	if got, err := ContextOf([]string{"nosuid", a, a}); err != nil || got != "u:r:a_t:s0:c1,c2" {
		t.Fatalf("ContextOf(a, a) = %q, %v", got, err)
	}
	if got, err := ContextOf([]string{"nosuid"}); err != nil || got != "" {
		t.Fatalf("ContextOf() = %q, %v", got, err)
	}
	if _, err := ContextOf([]string{a, b}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("two contexts: %v, want InvalidArgument", err)
	}
	if got := WithoutContext([]string{"ro", a, "noatime"}); len(got) != 2 || got[0] != "ro" || got[1] != "noatime" {
		t.Fatalf("WithoutContext = %q", got)
	}
}

func TestPolicyTakesContextOnMounts(t *testing.T) {
	p := Policy{Roots: []string{"/var/lib/mountplan"}}
	ctx := ContextOption("system_u:object_r:container_file_t:s0:c1,c2")
	if err := p.Validate([]Mount{{Type: "ext4", Source: "/dev/loop3", Options: []string{"nosuid", "nodev", ctx}}}); err != nil {
		t.Fatalf("ext4 with context: %v", err)
	}
	if err := p.Validate([]Mount{{Type: TypeBind, Source: "/var/lib/mountplan/x", Options: []string{"nosuid", "nodev", ctx}}}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("bind with context: %v, want InvalidArgument (a bind cannot relabel)", err)
	}
}
