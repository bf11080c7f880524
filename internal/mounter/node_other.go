//go:build !linux

package mounter

import "context"

// Local is the mounter's work in this process, on Linux only.
type Local struct{ Node }

// NewNode is implemented on Linux only.
func NewNode(context.Context, Options) (*Local, error) { return nil, errNotLinux }
