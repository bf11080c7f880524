package journal

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Shared records are what a source keeps about something several volumes
// use (an iSCSI session logged in once for all the LUNs of a target): one
// file per key under <state-dir>/shared/<kind>/, written durably by
// rename, since what it describes outlives the plugin (the node records
// it made, the sessions it owns). The driver owns them and their locks;
// a source reads and writes them only through the driver.

func (s *Store) sharedPath(kind, key string) (string, error) {
	if err := ValidID(kind); err != nil {
		return "", fmt.Errorf("shared record kind: %w", err)
	}
	if err := ValidID(key); err != nil {
		return "", fmt.Errorf("shared record key: %w", err)
	}
	return filepath.Join(filepath.Dir(s.dir), "shared", kind, key+".json"), nil
}

// GetShared returns the shared record kind/key, or nil when there is none.
func (s *Store) GetShared(kind, key string) ([]byte, error) {
	p, err := s.sharedPath(kind, key)
	if err != nil {
		return nil, err
	}
	b, err := os.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	return b, nil
}

// PutShared writes the shared record kind/key durably; nil data deletes it.
func (s *Store) PutShared(kind, key string, data []byte) error {
	p, err := s.sharedPath(kind, key)
	if err != nil {
		return err
	}
	if data == nil {
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("journal: %w", err)
		}
		return syncDir(filepath.Dir(p))
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return fmt.Errorf("journal: %w", err)
	}
	return writeRecord(p, data, true)
}

// SharedKeys lists the keys of kind's shared records, sorted.
func (s *Store) SharedKeys(kind string) ([]string, error) {
	if err := ValidID(kind); err != nil {
		return nil, err
	}
	ents, err := os.ReadDir(filepath.Join(filepath.Dir(s.dir), "shared", kind))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	var keys []string
	for _, e := range ents {
		if key, ok := strings.CutSuffix(e.Name(), ".json"); ok && !e.IsDir() && ValidID(key) == nil {
			keys = append(keys, key)
		}
	}
	slices.Sort(keys)
	return keys, nil
}
