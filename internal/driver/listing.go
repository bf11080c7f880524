package driver

import (
	"fmt"
	"slices"
	"strings"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/model"
)

// tokenPrefix starts every page token: "mp1:<ID>" names the first entry
// of the next page by its ID, not by a position, so volumes or snapshots
// made or deleted between pages never shift what a token points at.
const tokenPrefix = "mp1:"

// page returns the entries of sorted (ascending by id) from the one a
// starting token names, at most max of them (0: all), and the token of
// the next page ("" when none is left). A token this plugin did not make
// is Aborted, as CSI asks.
func page[T any](sorted []T, id func(T) string, token string, max int32) ([]T, string, error) {
	if max < 0 {
		return nil, "", invalid("max_entries must not be negative")
	}
	start := 0
	if token != "" {
		after, ok := strings.CutPrefix(token, tokenPrefix)
		if !ok || model.ValidID(after) != nil {
			return nil, "", fmt.Errorf("starting_token %q was not made by this plugin: %w", token, errdefs.ErrAborted)
		}
		start, _ = slices.BinarySearchFunc(sorted, after, func(e T, t string) int { return strings.Compare(id(e), t) })
	}
	rest := sorted[start:]
	if max == 0 || int(max) >= len(rest) {
		return rest, "", nil
	}
	return rest[:max], tokenPrefix + id(rest[max]), nil
}
