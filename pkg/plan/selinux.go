package plan

import (
	"fmt"
	"regexp"
	"strings"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// ContextKey is the mount option that labels every file of a mount with
// one SELinux context (Kubernetes' SELinuxMount: kubelet adds
// context="<the pod's label>" to the mount flags of NodeStageVolume and
// NodePublishVolume when the CSIDriver says seLinuxMount: true and the
// node runs SELinux). The other label options (fscontext, defcontext,
// rootcontext) are no CO's to set and stay refused.
const ContextKey = "context"

// otherLabelOptions are SELinux's other mount options: fscontext and
// rootcontext relabel the superblock and the root a policy would judge
// mounts by, defcontext labels what has no label, seclabel is a mount
// table's marker. No CO sends them and none is a pod's to choose.
var otherLabelOptions = map[string]bool{"fscontext": true, "defcontext": true, "rootcontext": true, "seclabel": true}

// maxContextLen bounds a label: real ones are well under 200 bytes.
const maxContextLen = 255

// contextRE is an SELinux security context as a CO writes it:
// user:role:type, then an MLS level or range when the policy has one.
// Identifiers are letters, digits, '_', '.' and '-' (checkpolicy's); a
// level is a sensitivity and an optional category set of single
// categories and ranges joined by commas; a range is low-high. Nothing
// else: no quote, no '=', no space, no separator a mount string knows.
var contextRE = func() *regexp.Regexp {
	id := `[A-Za-z0-9_][A-Za-z0-9_.-]*`
	cat := `c[0-9]{1,4}(\.c[0-9]{1,4})?`
	level := `s[0-9]{1,4}(:` + cat + `(,` + cat + `)*)?`
	return regexp.MustCompile(`^` + id + `:` + id + `:` + id + `(:` + level + `(-` + level + `)?)?$`)
}()

// ParseContext returns the label of a context= option: kubelet's quoted
// form context="u:r:t:s0:c1,c2" (the quotes keep the category list's
// commas from separating options in a mount string), or unquoted when
// the label holds no comma. ok is false for any other option. A context
// option that is not exactly one valid label is an error wrapping
// errdefs.ErrInvalidArgument: a label is the only thing it may carry, so
// no comma outside the quotes, no newline and no second option can ride
// in it.
func ParseContext(o string) (label string, ok bool, err error) {
	val, ok := strings.CutPrefix(o, ContextKey+"=")
	if !ok {
		return "", false, nil
	}
	if q, quoted := strings.CutPrefix(val, `"`); quoted {
		var closed bool
		if val, closed = strings.CutSuffix(q, `"`); !closed {
			return "", true, fmt.Errorf("mount option context= has an opening quote and no closing one: %w", errdefs.ErrInvalidArgument)
		}
	} else if strings.Contains(val, ",") {
		return "", true, fmt.Errorf("mount option context=%.64q has a comma outside quotes: the label's categories must be quoted (context=\"u:r:t:s0:c1,c2\"): %w", val, errdefs.ErrInvalidArgument)
	}
	if len(val) > maxContextLen || !contextRE.MatchString(val) {
		return "", true, fmt.Errorf("mount option context=%.64q is not an SELinux context (user:role:type[:level[-level]]): %w", val, errdefs.ErrInvalidArgument)
	}
	return val, true, nil
}

// CheckLabelOption refuses SELinux's mount options other than context=,
// and a context= that is not one label; other options pass. Errors wrap
// errdefs.ErrInvalidArgument.
func CheckLabelOption(o string) error {
	if key, _, _ := strings.Cut(o, "="); otherLabelOptions[key] {
		return fmt.Errorf("option %q: of SELinux's mount options only context= is accepted: %w", key, errdefs.ErrInvalidArgument)
	}
	_, _, err := ParseContext(o)
	return err
}

// ContextOption renders label as the option kubelet writes.
func ContextOption(label string) string { return ContextKey + `="` + label + `"` }

// ContextOf returns the one SELinux label among opts ("" for none).
// Errors wrap errdefs.ErrInvalidArgument: a malformed context option, or
// two different ones (a mount has one label).
func ContextOf(opts []string) (string, error) {
	var found string
	for _, o := range opts {
		label, ok, err := ParseContext(o)
		if err != nil {
			return "", err
		}
		if !ok {
			continue
		}
		if found != "" && found != label {
			return "", fmt.Errorf("mount options give two SELinux contexts, %q and %q: %w", found, label, errdefs.ErrInvalidArgument)
		}
		found = label
	}
	return found, nil
}

// IsContext reports whether o is a context= option, valid or not.
func IsContext(o string) bool { return strings.HasPrefix(o, ContextKey+"=") }

// WithoutContext returns opts without their context= options: what a bind
// may take of a CO's mount flags, the label being on the mount the bind
// comes from (a bind cannot relabel).
func WithoutContext(opts []string) []string {
	var out []string
	for _, o := range opts {
		if !IsContext(o) {
			out = append(out, o)
		}
	}
	return out
}
