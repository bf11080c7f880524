package fuseprofile

import (
	"errors"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/errdefs"
)

func TestCheckWord(t *testing.T) {
	for _, ok := range []string{"user@host:/srv/data", "remote:bucket/path", "/srv/images/a.sqfs", "22", "a~b%c+d"} {
		if err := CheckWord("source", ok); err != nil {
			t.Errorf("%q refused: %v", ok, err)
		}
	}
	for _, bad := range []string{"", "-oProxyCommand=x", "a;b", "a b", "$(id)", "`id`", "a|b", "a,b", "a=b", "a\nb", "/srv/../etc", "host:..", "{x}", strings.Repeat("a", 1025)} {
		err := CheckWord("source", bad)
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%q: got %v, want InvalidArgument", bad, err)
		}
	}
}

func TestOptionCheck(t *testing.T) {
	enum := Option{Name: "cache", Values: []string{"yes", "no"}}
	pat := Option{Name: "port", Pattern: "[0-9]{1,5}"}
	for _, c := range []struct {
		o    Option
		v    string
		want bool
	}{
		{enum, "yes", true}, {enum, "maybe", false}, {enum, "yes,no", false},
		{pat, "2222", true}, {pat, "22a", false}, {pat, "123456", false}, {pat, "-1", false},
	} {
		if err := c.o.Check(c.v); (err == nil) != c.want {
			t.Errorf("%s=%q: err %v, want ok=%t", c.o.Name, c.v, err, c.want)
		}
	}
}
