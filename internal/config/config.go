// Package config reads the admin's policy file (--config): everything that
// could touch an arbitrary host path or run a command is decided here, by
// the cluster admin, never by a PV or pod author.
package config

import (
	"fmt"
	"os"
	"path/filepath"

	"sigs.k8s.io/yaml"

	"github.com/mountplan/mountplan/internal/fuseprofile"
	"github.com/mountplan/mountplan/pkg/plan"
)

// DefaultStateDir is the plugin's --state-dir default, which is also the
// sidecar's default allowed root: the two must agree.
const DefaultStateDir = "/var/lib/mountplan"

// DefaultKubeletDir is kubelet's usual root directory, the --kubelet-dir
// default of the plugin and the sidecar.
const DefaultKubeletDir = "/var/lib/kubelet"

// Config is the plugin's admin policy.
type Config struct {
	// ImageRoots are the directories under which static loop volumes may
	// name their image (volume_context image=...). Empty: no static images.
	ImageRoots []string `json:"imageRoots,omitempty"`
	// MountPolicy narrows what plans may do.
	MountPolicy MountPolicy `json:"mountPolicy,omitempty"`
	// DefaultFsType is used when neither the request nor the StorageClass
	// names one. ext4 when empty.
	DefaultFsType string `json:"defaultFsType,omitempty"`
	// FuseProfiles are the FUSE daemons volumes may pick by name
	// (internal/fuseprofile).
	FuseProfiles []fuseprofile.Profile `json:"fuseProfiles,omitempty"`
	// NBD is the policy for NBD volumes (nbd.go).
	NBD NBDConfig `json:"nbd,omitempty"`
	// ISCSI is the policy for iSCSI volumes (iscsi.go).
	ISCSI ISCSIConfig `json:"iscsi,omitempty"`
}

// MountPolicy is the admin's part of plan.Policy.
type MountPolicy struct {
	// AllowSuidDev lets plans omit nosuid,nodev. Off by default: a volume's
	// contents are not trusted with setuid binaries or device nodes.
	AllowSuidDev bool `json:"allowSuidDev,omitempty"`
	// Types, when set, narrows the mount types a plan may use.
	Types []string `json:"types,omitempty"`
}

// Load reads path; an empty path gives the defaults. Unknown fields are an
// error so that a typo does not silently weaken the policy.
func Load(path string) (*Config, error) {
	if path == "" {
		return Parse(nil, "")
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return Parse(b, path)
}

// Parse reads a config file's contents (name is for errors) and checks
// them as Load does.
func Parse(data []byte, name string) (*Config, error) {
	c := &Config{}
	if err := yaml.UnmarshalStrict(data, c); err != nil {
		return nil, fmt.Errorf("config %s: %w", name, err)
	}
	if c.DefaultFsType == "" {
		c.DefaultFsType = "ext4"
	}
	for _, check := range []func() error{c.validateFuse, c.validateNBD, c.validateISCSI} {
		if err := check(); err != nil {
			return nil, fmt.Errorf("config %s: %w", name, err)
		}
	}
	if err := checkRoots("imageRoots", c.ImageRoots); err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return c, nil
}

// PlanPolicy is the plan policy of this config for plans whose host paths
// lie under roots (the state dir). The plugin applies it when it builds a
// plan and the sidecar, loading the same file, checks plans against it
// again: one source for both.
//
// Loop devices in a plan must be backed by an image under a root's images
// directory (provisioned, ephemeral and scratch images) or under one of
// the admin's ImageRoots (static images).
func (c *Config) PlanPolicy(roots ...string) plan.Policy {
	images := make([]string, 0, len(roots)+len(c.ImageRoots))
	for _, r := range roots {
		images = append(images, filepath.Join(r, "images"))
	}
	images = append(images, c.ImageRoots...)
	return plan.Policy{Types: c.MountPolicy.Types, Roots: roots, ImageRoots: images, AllowSuidDev: c.MountPolicy.AllowSuidDev}
}

func (c *Config) validateFuse() error { return fuseprofile.Validate(c.FuseProfiles) }
