package mounter

import (
	"crypto/rand"
	"encoding/hex"

	"github.com/mountplan/mountplan/internal/model"
)

// NBDBackendPrefix starts the backend identifier of every NBD device
// mountplan connects: "mountplan:<volume-id>:<32 hex digits>", the digits
// random and new for every connect. The mounter accepts no other form.
const NBDBackendPrefix = "mountplan:"

// NewNBDBackend returns a fresh backend identifier for a connect of
// volumeID's export.
func NewNBDBackend(volumeID string) (string, error) {
	if err := model.ValidID(volumeID); err != nil {
		return "", err
	}
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return NBDBackendPrefix + volumeID + ":" + hex.EncodeToString(b[:]), nil
}
