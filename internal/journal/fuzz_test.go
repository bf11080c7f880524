package journal

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/model"
)

// FuzzValidID: an ID the journal accepts is one plain file name, so no
// volume ID from a request can make the store read or write outside its
// directory, and the store's path for it stays there.
func FuzzValidID(f *testing.F) {
	for _, s := range []string{"pvc-0a1b", "a", ".", "..", "../etc/passwd", ".hidden", "a/b", "a\x00b", strings.Repeat("x", 129), "vol.json", "é"} {
		f.Add(s)
	}
	s := &Store[model.Volume]{dir: "/state/volumes"}
	f.Fuzz(func(t *testing.T, id string) {
		if model.ValidID(id) != nil {
			return
		}
		if id == "" || len(id) > 128 || strings.HasPrefix(id, ".") || strings.ContainsAny(id, "/\\\x00") || filepath.Base(id) != id {
			t.Fatalf("accepted %q", id)
		}
		if p := s.path(id); filepath.Dir(p) != s.dir || filepath.Clean(p) != p {
			t.Fatalf("%q is stored at %s, outside %s", id, p, s.dir)
		}
	})
}
