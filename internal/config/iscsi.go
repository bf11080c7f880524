package config

// ISCSIDefaultPort is the IANA port of iSCSI, used when a portal has none.
const ISCSIDefaultPort = 3260

// ISCSIConfig is what iSCSI volumes may log in to.
//
//	iscsi:
//	  allowedPortals: ["192.0.2.0/24:3260"]
//	  deviceTimeoutSeconds: 30
type ISCSIConfig struct {
	// AllowedPortals are the portals volumes may name, as EndpointRule
	// entries. Empty: no iSCSI volume is allowed.
	AllowedPortals []string `json:"allowedPortals,omitempty"`
	// DeviceTimeoutSeconds bounds discovery, login and the wait for the
	// SCSI disk after login. 0: 30.
	DeviceTimeoutSeconds int `json:"deviceTimeoutSeconds,omitempty"`
	// NodeDBDir is open-iscsi's node record directory, where the mounter
	// writes CHAP credentials into a record itself (mode 0600) instead of
	// passing them to iscsiadm on its command line. Empty: /etc/iscsi/nodes.
	NodeDBDir string `json:"nodeDBDir,omitempty"`
	// InitiatorNameFile holds this node's InitiatorName, used for the
	// plugin's own SendTargets discovery. Empty: /etc/iscsi/initiatorname.iscsi.
	InitiatorNameFile string `json:"initiatorNameFile,omitempty"`
}

// PortalRules returns the parsed AllowedPortals.
func (i ISCSIConfig) PortalRules() ([]EndpointRule, error) {
	return ParseEndpointRules("iscsi.allowedPortals", i.AllowedPortals)
}

func (c *Config) validateISCSI() error {
	i := c.ISCSI
	if _, err := i.PortalRules(); err != nil {
		return err
	}
	if err := checkNotNegative("iscsi.deviceTimeoutSeconds", i.DeviceTimeoutSeconds); err != nil {
		return err
	}
	var paths []string
	for _, p := range []string{i.NodeDBDir, i.InitiatorNameFile} {
		if p != "" {
			paths = append(paths, p)
		}
	}
	return checkRoots("iscsi paths", paths)
}
