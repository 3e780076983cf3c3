package broker

import (
	"encoding/base64"
	"encoding/json"

	clientcmdv1 "k8s.io/client-go/tools/clientcmd/api/v1"
	"sigs.k8s.io/yaml"
)

// buildKubeconfig returns a complete kubeconfig for the ServiceAccount:
// the cluster's external URL and CA bundle, the token, and a current
// context in the ServiceAccount's namespace, so that kubectl works with it
// as is.
func buildKubeconfig(cluster ClusterSpec, namespace, serviceAccount, token string) ([]byte, error) {
	user := serviceAccount + "@" + cluster.Name
	ctxName := namespace + "/" + serviceAccount + "@" + cluster.Name
	cfg := clientcmdv1.Config{
		APIVersion: "v1",
		Kind:       "Config",
		Clusters: []clientcmdv1.NamedCluster{{
			Name: cluster.Name,
			Cluster: clientcmdv1.Cluster{
				Server:                   cluster.Server,
				CertificateAuthorityData: []byte(cluster.CAData),
			},
		}},
		AuthInfos: []clientcmdv1.NamedAuthInfo{{
			Name:     user,
			AuthInfo: clientcmdv1.AuthInfo{Token: token},
		}},
		Contexts: []clientcmdv1.NamedContext{{
			Name: ctxName,
			Context: clientcmdv1.Context{
				Cluster:   cluster.Name,
				AuthInfo:  user,
				Namespace: namespace,
			},
		}},
		CurrentContext: ctxName,
	}
	return yaml.Marshal(cfg)
}

// jtiFromPayload extracts the jti claim from a JWT's base64url payload.
func jtiFromPayload(payload string) string {
	raw, err := base64.RawURLEncoding.DecodeString(payload)
	if err != nil {
		return ""
	}
	var claims struct {
		JTI string `json:"jti"`
	}
	if json.Unmarshal(raw, &claims) != nil {
		return ""
	}
	return claims.JTI
}
