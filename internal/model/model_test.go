package model

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/pkg/plan"
)

func TestValidIDRejectsPathsAndOddCharacters(t *testing.T) {
	for _, id := range []string{"", "../x", "a/b", ".hidden", "x\x00", "a b", string(make([]byte, 129))} {
		if err := ValidID(id); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("ValidID(%q) = %v, want ErrInvalidArgument", id, err)
		}
	}
	for _, id := range []string{"pvc-0b1c", "csi-abc.def_1", "A"} {
		if err := ValidID(id); err != nil {
			t.Errorf("ValidID(%q) = %v", id, err)
		}
	}
}

// TestClaimJSON: a claim keeps the flat form records have always had, so
// the claims written before an upgrade are read back with their namespace.
func TestClaimJSON(t *testing.T) {
	const old = `{"pid":42,"nsInode":7,"nsId":9,"mountPoint":"/data","mounts":[{"Type":"tmpfs","Source":"t","Target":"","Options":null}]}`
	var c Claim
	if err := json.Unmarshal([]byte(old), &c); err != nil {
		t.Fatal(err)
	}
	want := plan.Consumer{PID: 42, MountPoint: "/data", Namespace: plan.Namespace{Inode: 7, ID: 9}}
	if c.Consumer != want || len(c.Mounts) != 1 {
		t.Fatalf("decoded %+v, want %+v with one mount", c, want)
	}
	b, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	var back map[string]any
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"pid", "nsInode", "nsId", "mountPoint", "mounts"} {
		if _, ok := back[k]; !ok {
			t.Errorf("encoded claim %s lacks key %q", b, k)
		}
	}
}
